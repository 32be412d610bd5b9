//! Bit-width assignment (paper Eq. 2-3): rank thresholds that maximize a context's information under a global compression ratio.

use crate::level::{Level, LevelSet};

/// Why levels could not be assigned.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AssignError {
    #[error("the global ratio {ratio} is not a number in (0, 1]")]
    BadRatio { ratio: f64 },
    #[error(
        "the global ratio {ratio} is below the lightest level's ratio {lightest}; no assignment meets it"
    )]
    RatioTooLow { ratio: f64, lightest: f64 },
    #[error("chunk {chunk} has density {density}; densities must be finite and non-negative")]
    BadDensity { chunk: usize, density: f64 },
    #[error("{floors} current levels given for {chunks} chunks")]
    FloorCount { floors: usize, chunks: usize },
    #[error("chunk {chunk} is at level {level:?}, which the level set does not have")]
    UnknownLevel { chunk: usize, level: Level },
}

/// The outcome of [`assign_levels`].
#[derive(Debug, Clone, PartialEq)]
pub struct Assignment {
    /// Each chunk's level, in chunk order.
    pub levels: Vec<Level>,
    /// The rank thresholds sigma: ranks `[thresholds[w-1], thresholds[w])` get level `w`
    /// (before floors apply); the last entry is always the number of chunks.
    pub thresholds: Vec<usize>,
    /// The context's information, `sum of ratio(level_i) * D_i`.
    pub info: f64,
    /// The chosen levels' average ratio to the base.
    pub average_ratio: f64,
}

/// Assigns each chunk a level so that the context keeps the most information while the average
/// ratio to the base stays at or under `global_ratio` (Eq. 2-3).
///
/// Chunks are ranked by density, highest first (ties by chunk order); ranks below threshold
/// `sigma_0` keep level 0, ranks in `[sigma_0, sigma_1)` get level 1, and so on.
/// `floors` are the chunks' current levels: a chunk never goes back up, so its level is the
/// lighter of its floor and its rank's level, and the ratio is met by what is really assigned.
/// The information is `sum ratio_w * D_i`: the share of bits kept, weighted by density.
///
/// Exact over all threshold vectors: the outer thresholds are enumerated and the innermost one is
/// the largest that meets the ratio, found by binary search (information and cost both grow with
/// it), so three levels cost O(n log n) and `k` levels O(n^(k-2) log n).
pub fn assign_levels(
    densities: &[f64],
    floors: Option<&[Level]>,
    set: &LevelSet,
    global_ratio: f64,
) -> Result<Assignment, AssignError> {
    let n = densities.len();
    check_inputs(densities, floors, set, global_ratio)?;
    let k = set.len();
    let bits = set.costs();
    let base = f64::from(set.base_cost());
    let floor = |i: usize| floors.map_or(0, |f| usize::from(f[i].0));

    // Rank order: density descending, ties by chunk order.
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| densities[b].total_cmp(&densities[a]).then(a.cmp(&b)));

    // For each rank level w, prefix sums over ranks of the bits and information that a chunk gets
    // when its rank falls in level w's band (its floor may make it lighter).
    let mut cost = vec![vec![0u64; n + 1]; k];
    let mut info = vec![vec![0.0f64; n + 1]; k];
    for w in 0..k {
        for (p, &i) in order.iter().enumerate() {
            let b = bits[w.max(floor(i))];
            cost[w][p + 1] = cost[w][p] + u64::from(b);
            info[w][p + 1] = info[w][p] + f64::from(b) / base * densities[i];
        }
    }
    // sum bits / base <= ratio * n, in whole bits; the epsilon absorbs decimal ratios like 0.3.
    // A ratio that passed the check above affords every chunk at the lightest level, whatever
    // the rounding at large n.
    let budget = ((global_ratio * base * n as f64 + 1e-9).floor() as u64)
        .max(u64::from(bits[k - 1]) * n as u64);

    let mut search = Search {
        n,
        cost: &cost,
        info: &info,
        budget,
        sigma: vec![0; k],
        best: None,
    };
    search.outer(0, 0);
    // The budget affords the all-lightest thresholds, so the search always finds an answer; if it
    // did not, everything lightest is the safe one.
    let (best_info, thresholds) = search.best.unwrap_or_else(|| {
        let mut sigma = vec![0; k];
        sigma[k - 1] = n;
        (0.0, sigma)
    });

    let mut levels = vec![Level(0); n];
    let mut w = 0;
    let mut bits_total = 0u64;
    for (p, &i) in order.iter().enumerate() {
        while p >= thresholds[w] {
            w += 1;
        }
        let l = w.max(floor(i));
        levels[i] = Level(l as u8);
        bits_total += u64::from(bits[l]);
    }
    Ok(Assignment {
        levels,
        thresholds,
        info: best_info,
        average_ratio: if n == 0 {
            0.0
        } else {
            bits_total as f64 / base / n as f64
        },
    })
}

/// [`assign_levels`] per layer group: chunks `..split` and `split..` are ranked among
/// themselves and each meets `global_ratio` on its own.
///
/// On a model with sliding-window layers the chunks past the window (a prefix) keep their
/// global layers alone and are ranked by those layers' densities, the others by every layer's
/// ([`crate::GroupDensity::chunk_densities`]): the two groups' densities are on different scales
/// and their chunks hold different layers, so neither group's budget is spent on the other's.
/// With `split` 0 (no window) it is [`assign_levels`].
pub fn assign_levels_grouped(
    densities: &[f64],
    split: usize,
    floors: Option<&[Level]>,
    set: &LevelSet,
    global_ratio: f64,
) -> Result<Vec<Level>, AssignError> {
    check_inputs(densities, floors, set, global_ratio)?;
    let split = split.min(densities.len());
    let mut levels = Vec::with_capacity(densities.len());
    for range in [0..split, split..densities.len()] {
        if range.is_empty() {
            continue;
        }
        // The inputs were checked whole above, so errors name chunks of the whole context.
        let f = floors.map(|f| &f[range.clone()]);
        levels.extend(assign_levels(&densities[range], f, set, global_ratio)?.levels);
    }
    Ok(levels)
}

/// Checks [`assign_levels`]' inputs: a ratio in (0, 1] that affords the lightest level, finite
/// non-negative densities, one known floor per chunk.
fn check_inputs(
    densities: &[f64],
    floors: Option<&[Level]>,
    set: &LevelSet,
    global_ratio: f64,
) -> Result<(), AssignError> {
    let n = densities.len();
    if !(global_ratio > 0.0 && global_ratio <= 1.0) {
        return Err(AssignError::BadRatio {
            ratio: global_ratio,
        });
    }
    if let Some((chunk, &density)) = densities
        .iter()
        .enumerate()
        .find(|(_, d)| !d.is_finite() || **d < 0.0)
    {
        return Err(AssignError::BadDensity { chunk, density });
    }
    if let Some(f) = floors {
        if f.len() != n {
            return Err(AssignError::FloorCount {
                floors: f.len(),
                chunks: n,
            });
        }
        if let Some((chunk, &level)) = f.iter().enumerate().find(|(_, l)| !set.contains(**l)) {
            return Err(AssignError::UnknownLevel { chunk, level });
        }
    }
    let lightest = set.ratio(set.lightest()).unwrap_or(1.0);
    if global_ratio + 1e-12 < lightest {
        return Err(AssignError::RatioTooLow {
            ratio: global_ratio,
            lightest,
        });
    }
    Ok(())
}

struct Search<'a> {
    n: usize,
    cost: &'a [Vec<u64>],
    info: &'a [Vec<f64>],
    budget: u64,
    sigma: Vec<usize>,
    best: Option<(f64, Vec<usize>)>,
}

impl Search<'_> {
    /// Cost and information of the threshold vector `self.sigma`.
    fn eval(&self) -> (u64, f64) {
        let mut lo = 0;
        let (mut c, mut v) = (0, 0.0);
        for (w, &hi) in self.sigma.iter().enumerate() {
            c += self.cost[w][hi] - self.cost[w][lo];
            v += self.info[w][hi] - self.info[w][lo];
            lo = hi;
        }
        (c, v)
    }

    /// Enumerates thresholds `w..k-2` given `sigma[..w]`, the previous one being `from`.
    fn outer(&mut self, w: usize, from: usize) {
        let k = self.sigma.len();
        self.sigma[k - 1] = self.n;
        if k == 1 {
            self.consider();
            return;
        }
        if w + 2 < k {
            for s in from..=self.n {
                self.sigma[w] = s;
                self.outer(w + 1, s);
            }
            return;
        }
        // Innermost threshold: the largest that fits the budget.
        self.sigma[w] = from;
        if self.eval().0 > self.budget {
            return;
        }
        let (mut lo, mut hi) = (from, self.n);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            self.sigma[w] = mid;
            if self.eval().0 <= self.budget {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        self.sigma[w] = lo;
        self.consider();
    }

    fn consider(&mut self) {
        let (c, v) = self.eval();
        if c > self.budget {
            return;
        }
        if self.best.as_ref().is_none_or(|(b, _)| v > *b) {
            self.best = Some((v, self.sigma.clone()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn check(densities: &[f64], floors: Option<&[u8]>, ratio: f64, expected: &[u8]) {
        let floors: Option<Vec<Level>> = floors.map(|f| f.iter().map(|&l| Level(l)).collect());
        let a = assign_levels(densities, floors.as_deref(), &LevelSet::default(), ratio).unwrap();
        let got: Vec<u8> = a.levels.iter().map(|l| l.0).collect();
        assert_eq!(got, expected, "{densities:?} {ratio}");
    }

    #[test]
    fn cases() {
        // Everything fits at full precision.
        check(&[0.1, 0.9, 0.5], None, 1.0, &[0, 0, 0]);
        // 50% of four chunks: 8+8+2+2 = 20 > 16; 8+4+2+2 = 16 keeps more than 4+4+4+4.
        check(&[0.4, 0.3, 0.2, 0.1], None, 0.5, &[0, 1, 2, 2]);
        // One dominant chunk keeps 8 bits, the rest go to 2.
        check(&[0.01, 5.0, 0.01, 0.01], None, 0.5, &[1, 0, 2, 2]);
        // Only the lightest level.
        check(&[0.3, 0.2], None, 0.25, &[2, 2]);
        // Floors: chunk 0 is already at 2 bits and stays there; the budget it frees goes to others.
        check(
            &[0.9, 0.5, 0.1, 0.1],
            Some(&[2, 0, 0, 0]),
            0.5,
            &[2, 0, 1, 2],
        );
        check(&[], None, 0.5, &[]);
    }

    #[test]
    fn groups_are_ranked_and_budgeted_apart() {
        let set = LevelSet::default();
        // Two chunks past the window (global densities, small) and two within it (every layer's,
        // larger). Ranked together, the pair within the window takes the bits and the pair past
        // it goes to 2 bits; apart, each pair meets the ratio on its own.
        let d = [0.02, 0.01, 0.9, 0.8];
        let together = assign_levels(&d, None, &set, 0.5).unwrap().levels;
        assert_eq!(together, vec![Level(2), Level(2), Level(0), Level(1)]);
        let apart = assign_levels_grouped(&d, 2, None, &set, 0.5).unwrap();
        let each =
            |r: std::ops::Range<usize>| assign_levels(&d[r], None, &set, 0.5).unwrap().levels;
        assert_eq!(apart, [each(0..2), each(2..4)].concat());
        assert_eq!(apart, vec![Level(1); 4]);
        // No window: the plain assignment. Floors apply per chunk, and errors name the chunk of
        // the whole context.
        assert_eq!(
            assign_levels_grouped(&d, 0, None, &set, 0.5).unwrap(),
            together
        );
        let floors = [Level(2), Level(0), Level(0), Level(0)];
        let f = assign_levels_grouped(&d, 2, Some(&floors), &set, 0.5).unwrap();
        assert_eq!(f[0], Level(2));
        assert!(matches!(
            assign_levels_grouped(&[0.1, 0.1, f64::NAN], 1, None, &set, 0.5),
            Err(AssignError::BadDensity { chunk: 2, .. })
        ));
    }

    #[test]
    fn other_level_sets() {
        let set = LevelSet::new(4, &[4, 2, 1]).unwrap();
        let a = assign_levels(&[1.0, 0.0], None, &set, 0.75).unwrap();
        assert_eq!(a.levels, vec![Level(0), Level(1)]);
        let one = LevelSet::new(8, &[8]).unwrap();
        let a = assign_levels(&[1.0, 0.0], None, &one, 1.0).unwrap();
        assert_eq!(a.levels, vec![Level(0), Level(0)]);
        let four = LevelSet::new(8, &[8, 6, 4, 2]).unwrap();
        let a = assign_levels(&[1.0, 0.5, 0.2, 0.0], None, &four, 0.5).unwrap();
        assert!(a.average_ratio <= 0.5);
    }

    #[test]
    fn ratio_at_the_lightest_level_for_many_chunks() {
        // 0.25 minus less than the tolerance, over a million chunks: all at 2 bits, not refused.
        let d = vec![0.5; 1_000_000];
        let a = assign_levels(&d, None, &LevelSet::default(), 0.25 - 1e-13).unwrap();
        assert!(a.levels.iter().all(|l| *l == Level(2)));
    }

    #[test]
    fn errors() {
        let set = LevelSet::default();
        assert_eq!(
            assign_levels(&[1.0], None, &set, 0.2),
            Err(AssignError::RatioTooLow {
                ratio: 0.2,
                lightest: 0.25
            })
        );
        assert_eq!(
            assign_levels(&[1.0], None, &set, 0.0),
            Err(AssignError::BadRatio { ratio: 0.0 })
        );
        assert_eq!(
            assign_levels(&[1.0, f64::INFINITY], None, &set, 0.5),
            Err(AssignError::BadDensity {
                chunk: 1,
                density: f64::INFINITY
            })
        );
        assert_eq!(
            assign_levels(&[1.0], Some(&[]), &set, 0.5),
            Err(AssignError::FloorCount {
                floors: 0,
                chunks: 1
            })
        );
        assert_eq!(
            assign_levels(&[1.0], Some(&[Level(3)]), &set, 0.5),
            Err(AssignError::UnknownLevel {
                chunk: 0,
                level: Level(3)
            })
        );
    }

    /// Every threshold vector, evaluated directly: the best information reachable.
    fn brute_force(d: &[f64], floors: &[Level], set: &LevelSet, ratio: f64) -> Option<f64> {
        let n = d.len();
        let k = set.len();
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| d[b].total_cmp(&d[a]).then(a.cmp(&b)));
        let mut best: Option<f64> = None;
        let mut sigma = vec![0usize; k];
        fn rec(
            w: usize,
            from: usize,
            sigma: &mut Vec<usize>,
            f: &mut dyn FnMut(&[usize]),
            n: usize,
        ) {
            if w + 1 == sigma.len() {
                sigma[w] = n;
                f(sigma);
                return;
            }
            for s in from..=n {
                sigma[w] = s;
                rec(w + 1, s, sigma, f, n);
            }
        }
        let mut visit = |sigma: &[usize]| {
            let mut bits = 0.0;
            let mut info = 0.0;
            for (p, &i) in order.iter().enumerate() {
                let w = sigma.iter().position(|&s| p < s).unwrap();
                let l = Level(w.max(usize::from(floors[i].0)) as u8);
                let r = set.ratio(l).unwrap();
                bits += r;
                info += r * d[i];
            }
            if bits <= ratio * n as f64 + 1e-9 && best.is_none_or(|b| info > b) {
                best = Some(info);
            }
        };
        rec(0, 0, &mut sigma, &mut visit, n);
        best
    }

    proptest! {
        #[test]
        fn matches_brute_force(
            d in prop::collection::vec(0.0f64..1.0, 0..9),
            floor_seed in prop::collection::vec(0u8..3, 9),
            use_floors in any::<bool>(),
            ratio_eighths in 2u32..=8,
            set_kind in 0u8..3,
        ) {
            let set = match set_kind {
                0 => LevelSet::default(),
                1 => LevelSet::new(8, &[8, 6, 3, 2]).unwrap(),
                // The coded formats' stored bytes per chunk on SmolLM2 (k8v8, k4v4, k4v3).
                _ => LevelSet::weighted(&[199_184, 107_024, 95_504]).unwrap(),
            };
            let lightest = set.ratio(set.lightest()).unwrap();
            let ratio = (f64::from(ratio_eighths) / 8.0).max(lightest);
            let floors: Vec<Level> = (0..d.len())
                .map(|i| Level(if use_floors { floor_seed[i] % set.len() as u8 } else { 0 }))
                .collect();
            let a = assign_levels(&d, Some(&floors), &set, ratio).unwrap();
            let oracle = brute_force(&d, &floors, &set, ratio).unwrap();
            prop_assert!((a.info - oracle).abs() < 1e-9, "got {} oracle {}", a.info, oracle);
            // What is returned is what is claimed, meets the ratio and respects the floors.
            let mut info = 0.0;
            let mut sum = 0.0;
            for (i, l) in a.levels.iter().enumerate() {
                prop_assert!(*l >= floors[i]);
                let r = set.ratio(*l).unwrap();
                info += r * d[i];
                sum += r;
            }
            prop_assert!((info - a.info).abs() < 1e-9);
            prop_assert!(sum <= ratio * d.len() as f64 + 1e-9);
        }
    }
}
