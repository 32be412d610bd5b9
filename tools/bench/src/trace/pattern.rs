//! Context switching patterns (paper §4): which context each call of a trace goes to.
//!
//! - Random: every call picks a context uniformly.
//! - Markov: a first-order Markov chain over contexts with locality: from context `c`, the next
//!   call stays on `c` with probability `stay`, goes to one of its two ring neighbours
//!   (`c - 1`, `c + 1` mod n) with probability `neighbour` in total, and to any other context
//!   with the remaining probability, spread evenly ([`markov_matrix`]).
//! - Gaussian: popularity by workload: contexts are ranked by their source's mean prompt growth,
//!   and rank `r` is called with weight `exp(-((r - (n-1)/2) / (sigma n))² / 2)`, so contexts of
//!   moderate workload are called most ([`gaussian_weights`]).

use serde::{Deserialize, Serialize};

use super::rng::TraceRng;

/// A switching pattern and its parameters, as the trace header records it.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, strum::IntoStaticStr)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
#[strum(serialize_all = "snake_case")]
pub enum Pattern {
    /// Uniform: each call picks any context with probability 1/n.
    Random,
    /// First-order Markov chain with locality ([`markov_matrix`]).
    Markov {
        /// Probability that the next call goes to the same context.
        stay: f64,
        /// Probability that it goes to one of the two ring neighbours (split evenly).
        neighbour: f64,
    },
    /// Popularity: a discrete Gaussian over contexts ranked by workload ([`gaussian_weights`]).
    Gaussian {
        /// The Gaussian's standard deviation as a fraction of the number of contexts.
        sigma: f64,
    },
}

/// The Markov pattern's defaults: half the calls stay, 30% go to a neighbour.
pub const DEFAULT_STAY: f64 = 0.5;
/// See [`DEFAULT_STAY`].
pub const DEFAULT_NEIGHBOUR: f64 = 0.3;
/// The Gaussian pattern's default spread: σ = n/4.
pub const DEFAULT_SIGMA: f64 = 0.25;

impl Pattern {
    /// The name on the command line and in the header: `random`, `markov`, `gaussian`.
    pub fn name(&self) -> &'static str {
        self.into()
    }

    /// Why these parameters make no pattern, if they do not.
    pub fn check(&self) -> Result<(), String> {
        let prob = |name: &str, p: f64| {
            if (0.0..=1.0).contains(&p) {
                Ok(())
            } else {
                Err(format!("{name} must be a probability from 0 to 1, not {p}"))
            }
        };
        match *self {
            Pattern::Random => Ok(()),
            Pattern::Markov { stay, neighbour } => {
                prob("stay", stay)?;
                prob("neighbour", neighbour)?;
                if stay + neighbour > 1.0 + 1e-12 {
                    return Err(format!(
                        "stay + neighbour must be at most 1, not {stay} + {neighbour}"
                    ));
                }
                Ok(())
            }
            Pattern::Gaussian { sigma } => {
                if sigma.is_finite() && sigma > 0.0 {
                    Ok(())
                } else {
                    Err(format!("sigma must be a positive number, not {sigma}"))
                }
            }
        }
    }
}

/// The Markov pattern's transition matrix over `n` contexts: `m[from][to]`, rows summing to 1.
///
/// From `c`: `stay` to `c`; `neighbour / 2` to each of `c - 1` and `c + 1` (mod n; with two
/// contexts both are the other one, with one context everything stays); the rest evenly over the
/// contexts that are neither `c` nor a neighbour, or over every other context when there are none
/// (n ≤ 3), or back to `c` when there is no other context (n = 1).
pub fn markov_matrix(n: usize, stay: f64, neighbour: f64) -> Vec<Vec<f64>> {
    (0..n)
        .map(|c| {
            let mut row = vec![0.0; n];
            if n == 1 {
                row[0] = 1.0;
                return row;
            }
            row[c] += stay;
            let next = (c + 1) % n;
            let prev = (c + n - 1) % n;
            row[next] += neighbour / 2.0;
            row[prev] += neighbour / 2.0;
            let rest = 1.0 - stay - neighbour;
            let far: Vec<usize> = (0..n)
                .filter(|&j| j != c && j != next && j != prev)
                .collect();
            let others: Vec<usize> = if far.is_empty() {
                (0..n).filter(|&j| j != c).collect()
            } else {
                far
            };
            for &j in &others {
                row[j] += rest / others.len() as f64;
            }
            row
        })
        .collect()
}

/// The Gaussian pattern's weight of each context (not normalised), given each context's
/// workload (its source's mean prompt growth): contexts sorted by workload (ties by index) get
/// ranks 0..n, and rank `r` weighs `exp(-((r - (n-1)/2) / (sigma n))² / 2)`.
pub fn gaussian_weights(workloads: &[f64], sigma: f64) -> Vec<f64> {
    let n = workloads.len();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| workloads[a].total_cmp(&workloads[b]).then(a.cmp(&b)));
    let mu = (n as f64 - 1.0) / 2.0;
    let sd = sigma * n as f64;
    let mut w = vec![0.0; n];
    for (rank, &ctx) in order.iter().enumerate() {
        let z = (rank as f64 - mu) / sd;
        w[ctx] = (-0.5 * z * z).exp();
    }
    w
}

fn cdf(weights: &[f64]) -> Vec<f64> {
    weights
        .iter()
        .scan(0.0, |acc, &w| {
            *acc += w;
            Some(*acc)
        })
        .collect()
}

/// Draws the context of each call in turn.
pub struct Switcher {
    /// One cumulative distribution per current context (Markov), or one for all.
    cdfs: Vec<Vec<f64>>,
    markov: bool,
    current: Option<usize>,
}

impl Switcher {
    /// The switcher of `pattern` over contexts with these workloads (used by Gaussian).
    pub fn new(pattern: Pattern, workloads: &[f64]) -> Switcher {
        let n = workloads.len();
        match pattern {
            Pattern::Random => Switcher {
                cdfs: vec![cdf(&vec![1.0; n])],
                markov: false,
                current: None,
            },
            Pattern::Markov { stay, neighbour } => Switcher {
                cdfs: markov_matrix(n, stay, neighbour)
                    .iter()
                    .map(|r| cdf(r))
                    .collect(),
                markov: true,
                current: None,
            },
            Pattern::Gaussian { sigma } => Switcher {
                cdfs: vec![cdf(&gaussian_weights(workloads, sigma))],
                markov: false,
                current: None,
            },
        }
    }

    /// The context of the next call. A Markov chain starts on a uniformly drawn context.
    pub fn next(&mut self, rng: &mut TraceRng) -> usize {
        let c = match (self.markov, self.current) {
            (true, Some(cur)) => rng.pick_cdf(&self.cdfs[cur]),
            (true, None) => rng.below(self.cdfs.len() as u64) as usize,
            (false, _) => rng.pick_cdf(&self.cdfs[0]),
        };
        self.current = Some(c);
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// |observed - expected| within 5 standard deviations of a binomial count, plus one.
    fn close(observed: u64, trials: u64, p: f64) -> bool {
        let mean = trials as f64 * p;
        let sd = (trials as f64 * p * (1.0 - p)).sqrt();
        (observed as f64 - mean).abs() <= 5.0 * sd + 1.0
    }

    #[test]
    fn markov_rows_are_distributions_with_the_stated_locality() {
        for n in 1..=9 {
            for (stay, neighbour) in [(0.5, 0.3), (0.0, 0.0), (1.0, 0.0), (0.2, 0.8), (0.1, 0.1)] {
                let m = markov_matrix(n, stay, neighbour);
                for (c, row) in m.iter().enumerate() {
                    let sum: f64 = row.iter().sum();
                    assert!((sum - 1.0).abs() < 1e-12, "n={n} row {c}: {row:?}");
                    assert!(row.iter().all(|&p| p >= 0.0));
                    if n >= 2 {
                        assert!((row[c] - stay).abs() < 1e-12, "n={n}");
                    }
                    if n >= 4 {
                        assert!((row[(c + 1) % n] - neighbour / 2.0).abs() < 1e-12);
                        let far = (1.0 - stay - neighbour) / (n - 3) as f64;
                        assert!((row[(c + 2) % n] - far).abs() < 1e-12, "n={n}");
                    }
                }
            }
        }
        assert_eq!(
            markov_matrix(2, 0.5, 0.3),
            vec![vec![0.5, 0.5], vec![0.5, 0.5]]
        );
    }

    #[test]
    fn markov_transition_frequencies_match_the_matrix() {
        let n = 6;
        let (stay, neighbour) = (0.5, 0.3);
        let m = markov_matrix(n, stay, neighbour);
        let mut sw = Switcher::new(Pattern::Markov { stay, neighbour }, &[1.0; 6]);
        let mut rng = TraceRng::new(11);
        let mut counts = vec![vec![0u64; n]; n];
        let mut prev = sw.next(&mut rng);
        for _ in 0..300_000 {
            let c = sw.next(&mut rng);
            counts[prev][c] += 1;
            prev = c;
        }
        for from in 0..n {
            let total: u64 = counts[from].iter().sum();
            for to in 0..n {
                assert!(
                    close(counts[from][to], total, m[from][to]),
                    "{from}->{to}: {} of {total}, expected p={}",
                    counts[from][to],
                    m[from][to]
                );
            }
        }
    }

    #[test]
    fn random_is_uniform_and_switches_1_minus_1_over_n_of_the_time() {
        let n = 8;
        let mut sw = Switcher::new(Pattern::Random, &[1.0; 8]);
        let mut rng = TraceRng::new(5);
        let mut counts = vec![0u64; n];
        let mut switches = 0u64;
        let trials = 200_000u64;
        let mut prev = sw.next(&mut rng);
        for _ in 0..trials {
            let c = sw.next(&mut rng);
            counts[c] += 1;
            switches += u64::from(c != prev);
            prev = c;
        }
        for &c in &counts {
            assert!(close(c, trials, 1.0 / n as f64), "{counts:?}");
        }
        assert!(close(switches, trials, 1.0 - 1.0 / n as f64), "{switches}");
    }

    #[test]
    fn gaussian_favours_moderate_workloads_in_the_stated_shape() {
        // Workloads deliberately not in index order: context 3 is the lightest, 0 the heaviest.
        let workloads = [1500.0, 300.0, 200.0, 55.0, 750.0, 350.0, 100.0, 1000.0];
        let sigma = 0.25;
        let w = gaussian_weights(&workloads, sigma);
        let total: f64 = w.iter().sum();
        // Ranks: 3,6,2,1,5,4,7,0; the two middle ranks (3 and 4) are contexts 1 and 5.
        assert!(w[1] == w[5] && w.iter().all(|&x| x <= w[1]));
        assert!(w[3] == w[0] && w.iter().all(|&x| x >= w[3]));
        let mut sw = Switcher::new(Pattern::Gaussian { sigma }, &workloads);
        let mut rng = TraceRng::new(9);
        let trials = 200_000u64;
        let mut counts = [0u64; 8];
        for _ in 0..trials {
            counts[sw.next(&mut rng)] += 1;
        }
        for c in 0..8 {
            assert!(
                close(counts[c], trials, w[c] / total),
                "context {c}: {} of {trials}, expected p={}",
                counts[c],
                w[c] / total
            );
        }
        // The shape: rank r against (n-1)/2 in units of σn = 2: the middle ranks are
        // exp(-(0.5/2)²/2) ≈ 0.969 and the ends exp(-(3.5/2)²/2) ≈ 0.216 of the peak.
        assert!((w[1] - (-0.5f64 * 0.0625).exp()).abs() < 1e-12);
        assert!((w[0] - (-0.5f64 * 3.0625).exp()).abs() < 1e-12);
    }

    #[test]
    fn bad_parameters_are_refused_with_their_name() {
        let bad = [
            (
                Pattern::Markov {
                    stay: 1.2,
                    neighbour: 0.0,
                },
                "stay",
            ),
            (
                Pattern::Markov {
                    stay: 0.5,
                    neighbour: -0.1,
                },
                "neighbour",
            ),
            (
                Pattern::Markov {
                    stay: 0.7,
                    neighbour: 0.5,
                },
                "at most 1",
            ),
            (Pattern::Gaussian { sigma: 0.0 }, "sigma"),
            (Pattern::Gaussian { sigma: f64::NAN }, "sigma"),
        ];
        for (p, says) in bad {
            let e = p.check().unwrap_err();
            assert!(e.contains(says), "{p:?}: {e}");
        }
        assert!(Pattern::Random.check().is_ok());
    }
}
