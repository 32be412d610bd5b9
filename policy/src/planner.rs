//! The swapping-recompute planner (paper Eq. 4): which missing chunks to read and which to recompute, so the Load pipeline finishes first.
//!
//! The pipeline model (docs/policy.md says why):
//! - Reads go one after another in one stream; reading `r` chunks of `m` bytes takes `T_IO(m)`.
//! - The recompute set `R` is recomputed in one forward pass over its tokens, all layers, taking
//!   `T_re(|R|)`; at each layer it attends over the K/V of every earlier chunk.
//! - So every read chunk positioned before the last recomputed chunk must be in memory before the
//!   pass starts (a chunk file is read whole, all layers at once): those "blocking" reads go
//!   first in the stream, and the pass starts when they are done; the other reads ("tail")
//!   stream on while the pass runs.
//! - The delay is when both are done:
//!   `max(T_IO(blocking + tail), T_IO(blocking) + T_re(|R|))`, with `T_IO(blocking) = 0` when
//!   there is no blocking read.
//! - When chunks can be read in `G` pieces of layers ([`CostModel::read_groups`]), the pass at
//!   layer group `g` waits only for group `g` of the blocking reads, and the pass ends at
//!   [`CostModel::recompute_end`]; `G = 1` is the formula above.
//!
//! The planner finds the split with the least delay exactly: for each choice of the last
//! recomputed chunk `c`, the blocking reads are some `j` of the missing chunks before it, best
//! the `j` smallest, and the delay is convex in `j` past `j = 0`, so a binary search over `j`
//! with an order-statistics tree of sizes gives O(n log^2 n) for `n` missing chunks.

use crate::cost::CostModel;

/// A chunk of the context that is not in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MissingChunk {
    /// Its position in the context (chunk index).
    pub index: u32,
    /// The bytes to read for it from the store, at its stored level.
    pub bytes: u64,
}

/// The planner's prediction for a plan, in seconds from the start of the Load.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Prediction {
    /// When the last chunk is in memory: `max(io_end, recompute_end)`.
    pub total: f64,
    /// When the last read completes (0 without reads).
    pub io_end: f64,
    /// When the blocking reads are done and the recompute pass can start.
    pub recompute_start: f64,
    /// When the recompute pass ends (0 without recompute).
    pub recompute_end: f64,
}

/// How to bring a context's missing chunks back.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LoadPlan {
    /// Chunks to recompute, in one pass, ascending.
    pub recompute: Vec<u32>,
    /// Chunks to read first, ascending: the recompute pass needs them.
    pub read_first: Vec<u32>,
    /// Chunks to read after those, ascending, while the recompute pass runs.
    pub read_after: Vec<u32>,
    /// The bytes read in all.
    pub read_bytes: u64,
    pub predicted: Prediction,
}

/// Why a plan could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("chunk {index} is listed twice among the missing chunks")]
    Duplicate { index: u32 },
    #[error("chunk {index} is to be recomputed but is not missing")]
    NotMissing { index: u32 },
}

/// Sorts by index and refuses duplicates.
fn sorted(missing: &[MissingChunk]) -> Result<Vec<MissingChunk>, PlanError> {
    let mut m = missing.to_vec();
    m.sort_by_key(|c| c.index);
    if let Some(w) = m.windows(2).find(|w| w[0].index == w[1].index) {
        return Err(PlanError::Duplicate { index: w[0].index });
    }
    Ok(m)
}

/// The plan that recomputes exactly `recompute` and reads every other missing chunk, with its
/// predicted delay: how any split (read everything, recompute everything, the paper's) fares
/// under the same model.
pub fn evaluate(
    missing: &[MissingChunk],
    recompute: &[u32],
    model: &CostModel,
) -> Result<LoadPlan, PlanError> {
    let m = sorted(missing)?;
    let mut re: Vec<u32> = recompute.to_vec();
    re.sort_unstable();
    re.dedup();
    if let Some(&index) = re
        .iter()
        .find(|&&i| m.binary_search_by_key(&i, |c| c.index).is_err())
    {
        return Err(PlanError::NotMissing { index });
    }
    let last = re.last().copied();
    let mut plan = LoadPlan {
        recompute: re,
        ..LoadPlan::default()
    };
    let mut first_bytes = 0u64;
    let mut after_bytes = 0u64;
    for c in &m {
        if plan.recompute.binary_search(&c.index).is_ok() {
            continue;
        }
        if last.is_some_and(|l| c.index < l) {
            plan.read_first.push(c.index);
            first_bytes += c.bytes;
        } else {
            plan.read_after.push(c.index);
            after_bytes += c.bytes;
        }
    }
    plan.read_bytes = first_bytes + after_bytes;
    let (blocking, first) = (plan.read_first.len(), first_bytes as f64);
    let reads = blocking + plan.read_after.len();
    let io_end = model.io.eval_items(reads, plan.read_bytes as f64);
    let recompute_end = model.recompute_end(plan.recompute.len(), blocking, first);
    plan.predicted = Prediction {
        total: io_end.max(recompute_end),
        io_end,
        recompute_start: if plan.recompute.is_empty() {
            0.0
        } else {
            model.recompute_start(blocking, first)
        },
        recompute_end,
    };
    Ok(plan)
}

/// Counts and byte sums over size ranks, to sum the `j` smallest sizes inserted so far.
struct OrderStats {
    count: Vec<u32>,
    sum: Vec<u64>,
    top: usize,
}

impl OrderStats {
    fn new(n: usize) -> Self {
        Self {
            count: vec![0; n + 1],
            sum: vec![0; n + 1],
            top: if n == 0 { 0 } else { 1 << n.ilog2() },
        }
    }

    fn insert(&mut self, rank: usize, bytes: u64) {
        let mut i = rank + 1;
        while i < self.count.len() {
            self.count[i] += 1;
            self.sum[i] += bytes;
            i += i & i.wrapping_neg();
        }
    }

    /// The sum of the `j` smallest inserted sizes (`j` at most the number inserted).
    fn smallest(&self, j: usize) -> u64 {
        let (mut pos, mut left, mut acc) = (0, j as u32, 0u64);
        let mut step = self.top;
        while step > 0 {
            let next = pos + step;
            if next < self.count.len() && self.count[next] <= left {
                pos = next;
                left -= self.count[pos];
                acc += self.sum[pos];
            }
            step >>= 1;
        }
        acc
    }
}

/// The split of `missing` into reads and recompute with the least predicted delay under `model`,
/// exact for the pipeline model of this module.
pub fn plan_load(missing: &[MissingChunk], model: &CostModel) -> Result<LoadPlan, PlanError> {
    plan_load_from(missing, model, 0)
}

/// [`plan_load`] where the chunks before `first_recomputable` can only be read (a sliding-window
/// model's chunks past the window: their exact rebuild would need thousands of tokens of
/// lookback). Those reads precede every recompute, so they block it: the delay of each
/// candidate counts them among the reads first.
pub fn plan_load_from(
    missing: &[MissingChunk],
    model: &CostModel,
    first_recomputable: u32,
) -> Result<LoadPlan, PlanError> {
    let m = sorted(missing)?;
    let n = m.len();
    let io = model.io;
    let re = model.recompute;
    // Size ranks: by bytes, ties by position.
    let mut by_size: Vec<usize> = (0..n).collect();
    by_size.sort_by_key(|&p| (m[p].bytes, p));
    let mut rank = vec![0; n];
    for (r, &p) in by_size.iter().enumerate() {
        rank[p] = r;
    }
    let mut suffix = vec![0u64; n + 1];
    for p in (0..n).rev() {
        suffix[p] = suffix[p + 1] + m[p].bytes;
    }

    // The chunks that can only be read: a prefix of the positions, read before any recompute.
    let forced = m
        .iter()
        .take_while(|c| c.index < first_recomputable)
        .count();
    let forced_bytes = (suffix[0] - suffix[forced]) as f64;

    // Candidate: read everything.
    let mut best = (io.eval_items(n, suffix[0] as f64), 0usize, 0usize);
    let mut pool = OrderStats::new(n);
    for c in forced + 1..=n {
        // The last recomputed chunk is m[c - 1]; the pool is the recomputable chunks before it.
        if c >= forced + 2 {
            pool.insert(rank[c - 2], m[c - 2].bytes);
        }
        let tail_n = n - c;
        let tail_bytes = suffix[c] as f64;
        // j = 0: recompute all c - forced recomputable chunks, the tail streams alongside.
        let d0 = if forced == 0 {
            re.eval(c as f64).max(io.eval_items(tail_n, tail_bytes))
        } else {
            model
                .recompute_end(c - forced, forced, forced_bytes)
                .max(io.fixed() + io.per_unit() * (forced_bytes + tail_bytes))
        };
        if d0 < best.0 {
            best = (d0, c, 0);
        }
        if c < forced + 2 {
            continue;
        }
        // j >= 1: the j smallest recomputable ones before it are read first (with the forced
        // reads); the delay is convex in j (the j smallest sizes add up convexly, recompute
        // falls linearly, and the maxima and sums of convex functions are convex).
        let g = |j: usize| {
            let first = forced_bytes + pool.smallest(j) as f64;
            model
                .recompute_end(c - forced - j, forced + j, first)
                .max(io.fixed() + io.per_unit() * (first + tail_bytes))
        };
        let (mut lo, mut hi) = (1, c - forced - 1);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if g(mid + 1) < g(mid) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let d = g(lo);
        if d < best.0 {
            best = (d, c, lo);
        }
    }

    let (_, c, j) = best;
    let mut recompute = Vec::new();
    if c > 0 {
        let mut before: Vec<usize> = (forced..c - 1).collect();
        before.sort_by_key(|&p| rank[p]);
        recompute.extend(before[j..].iter().map(|&p| m[p].index));
        recompute.push(m[c - 1].index);
    }
    evaluate(&m, &recompute, model)
}

/// The paper's plan (Eq. 4 as written): recompute the `k` largest missing chunks, `k` chosen to
/// minimize `max(T_re(k), T_IO(rest))` as if recompute needed nothing read.
///
/// Returned with the paper's own estimate and evaluated under this module's model, which knows
/// that recompute waits for the reads before it: the gap is what ignoring the dependency costs.
pub fn plan_order_blind(
    missing: &[MissingChunk],
    model: &CostModel,
) -> Result<(LoadPlan, f64), PlanError> {
    let m = sorted(missing)?;
    let mut by_size: Vec<&MissingChunk> = m.iter().collect();
    // Largest first; among equals the earliest, which blocks least.
    by_size.sort_by_key(|c| (std::cmp::Reverse(c.bytes), c.index));
    let total: u64 = m.iter().map(|c| c.bytes).sum();
    let n = m.len();
    let mut best = (model.io.eval_items(n, total as f64), 0);
    let mut recomputed = 0u64;
    for (k, c) in by_size.iter().enumerate() {
        recomputed += c.bytes;
        let d = model
            .recompute
            .eval((k + 1) as f64)
            .max(model.io.eval_items(n - k - 1, (total - recomputed) as f64));
        if d < best.0 {
            best = (d, k + 1);
        }
    }
    let recompute: Vec<u32> = by_size[..best.1].iter().map(|c| c.index).collect();
    Ok((evaluate(&m, &recompute, model)?, best.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::LinearCost;
    use proptest::prelude::*;

    fn model(io_fixed: f64, per_byte: f64, re_fixed: f64, per_chunk: f64) -> CostModel {
        CostModel::new(
            LinearCost::new(re_fixed, per_chunk).unwrap(),
            LinearCost::new(io_fixed, per_byte).unwrap(),
        )
    }

    fn chunks(sizes: &[u64]) -> Vec<MissingChunk> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &bytes)| MissingChunk {
                index: i as u32,
                bytes,
            })
            .collect()
    }

    fn check(sizes: &[u64], m: CostModel, recompute: &[u32], total: f64) {
        let plan = plan_load(&chunks(sizes), &m).unwrap();
        assert_eq!(plan.recompute, recompute, "{plan:?}");
        assert!((plan.predicted.total - total).abs() < 1e-9, "{plan:?}");
    }

    #[test]
    fn cases() {
        // Nothing missing.
        check(&[], model(1.0, 1.0, 1.0, 1.0), &[], 0.0);
        // Recompute is free: recompute everything.
        check(&[10, 10, 10], model(0.0, 1.0, 0.0, 0.0), &[0, 1, 2], 0.0);
        // Recompute is very dear: read everything.
        check(&[10, 10, 10], model(0.0, 1.0, 0.0, 1000.0), &[], 30.0);
        // Balanced: recompute the first three (3 s) while reading the last (2 s).
        check(&[2, 2, 2, 2], model(0.0, 1.0, 0.0, 1.0), &[0, 1, 2], 3.0);
        // The big chunk is last: read the small ones first (3 s), then recompute it (10 s).
        check(&[1, 1, 1, 100], model(0.0, 1.0, 0.0, 10.0), &[3], 13.0);
        // A small chunk early is cheaper to read than to recompute, though reading it blocks
        // the pass: read it first (1 s), then recompute the rest (6 s).
        check(&[1, 50, 50, 50], model(0.0, 1.0, 0.0, 2.0), &[1, 2, 3], 7.0);
        // A fixed I/O cost makes one read dearer than recomputing it.
        check(&[1, 50], model(5.0, 1.0, 0.0, 2.0), &[0, 1], 4.0);
    }

    #[test]
    fn plan_shape() {
        let plan = plan_load(&chunks(&[1, 50, 50, 50, 5]), &model(0.0, 1.0, 0.0, 2.0)).unwrap();
        assert_eq!(plan.read_first, vec![0]);
        assert_eq!(plan.recompute, vec![1, 2, 3]);
        assert_eq!(plan.read_after, vec![4]);
        assert_eq!(plan.read_bytes, 6);
        assert_eq!(plan.predicted.recompute_start, 1.0);
        assert_eq!(plan.predicted.recompute_end, 7.0);
        assert_eq!(plan.predicted.io_end, 6.0);
        assert_eq!(plan.predicted.total, 7.0);
    }

    #[test]
    fn order_blind_plan_waits_for_reads() {
        // The paper recomputes the big last chunk, assuming it overlaps the small reads; it
        // really waits for them.
        let m = model(0.0, 1.0, 0.0, 10.0);
        let (plan, estimate) = plan_order_blind(&chunks(&[5, 5, 5, 100]), &m).unwrap();
        assert_eq!(plan.recompute, vec![3]);
        assert_eq!(estimate, 15.0);
        assert_eq!(plan.predicted.total, 25.0);
        // Read in layer groups, the wait shrinks to the first group's.
        let grouped = CostModel {
            read_groups: 5,
            ..m
        };
        let plan = plan_load(&chunks(&[5, 5, 5, 100]), &grouped).unwrap();
        assert_eq!(plan.recompute, vec![3]);
        assert_eq!(plan.predicted.recompute_start, 3.0);
        assert_eq!(plan.predicted.total, 17.0);
    }

    #[test]
    fn errors() {
        let m = model(0.0, 1.0, 0.0, 1.0);
        let dup = [
            MissingChunk { index: 3, bytes: 1 },
            MissingChunk { index: 3, bytes: 2 },
        ];
        assert_eq!(plan_load(&dup, &m), Err(PlanError::Duplicate { index: 3 }));
        assert_eq!(
            evaluate(&chunks(&[1]), &[4], &m),
            Err(PlanError::NotMissing { index: 4 })
        );
    }

    proptest! {
        #[test]
        fn matches_every_split(
            sizes in prop::collection::vec(1u64..200, 0..11),
            gaps in prop::collection::vec(1u32..4, 11),
            io_fixed in 0.0f64..50.0,
            per_byte in 0.0f64..2.0,
            re_fixed in 0.0f64..50.0,
            per_chunk in 0.0f64..150.0,
            read_groups in prop_oneof![Just(1u32), 1u32..40],
        ) {
            let m = CostModel {
                read_groups,
                ..model(io_fixed, per_byte, re_fixed, per_chunk)
            };
            // Positions with gaps: present chunks sit between missing ones.
            let mut index = 0;
            let missing: Vec<MissingChunk> = sizes
                .iter()
                .zip(&gaps)
                .map(|(&bytes, &g)| {
                    index += g;
                    MissingChunk { index, bytes }
                })
                .collect();
            let plan = plan_load(&missing, &m).unwrap();
            let mut oracle = f64::INFINITY;
            for mask in 0u32..(1 << missing.len()) {
                let re: Vec<u32> = missing
                    .iter()
                    .enumerate()
                    .filter(|(k, _)| mask & (1 << k) != 0)
                    .map(|(_, c)| c.index)
                    .collect();
                oracle = oracle.min(evaluate(&missing, &re, &m).unwrap().predicted.total);
            }
            let tol = 1e-9 * oracle.max(1.0);
            prop_assert!(
                (plan.predicted.total - oracle).abs() <= tol,
                "plan {} oracle {} {:?}", plan.predicted.total, oracle, plan
            );
            // Every missing chunk is covered exactly once.
            let mut all: Vec<u32> = plan
                .recompute
                .iter()
                .chain(&plan.read_first)
                .chain(&plan.read_after)
                .copied()
                .collect();
            all.sort_unstable();
            prop_assert_eq!(all, missing.iter().map(|c| c.index).collect::<Vec<_>>());
            // The order-blind plan is never better under the real dependency, and its own
            // estimate never exceeds what it really costs.
            let (blind, estimate) = plan_order_blind(&missing, &m).unwrap();
            prop_assert!(blind.predicted.total + tol >= plan.predicted.total);
            prop_assert!(estimate <= blind.predicted.total + tol);
        }

        /// With the chunks before `first` read-only (past a sliding window), the plan is the
        /// best of every split that recomputes none of them.
        #[test]
        fn read_only_chunks_match_every_allowed_split(
            sizes in prop::collection::vec(1u64..200, 0..10),
            first in 0u32..12,
            io_fixed in 0.0f64..50.0,
            per_byte in 0.0f64..2.0,
            re_fixed in 0.0f64..50.0,
            per_chunk in 0.0f64..150.0,
            read_groups in prop_oneof![Just(1u32), 1u32..40],
        ) {
            let m = CostModel {
                read_groups,
                ..model(io_fixed, per_byte, re_fixed, per_chunk)
            };
            let missing = chunks(&sizes);
            let plan = plan_load_from(&missing, &m, first).unwrap();
            prop_assert!(plan.recompute.iter().all(|&i| i >= first), "{:?}", plan);
            let mut oracle = f64::INFINITY;
            for mask in 0u32..(1 << missing.len()) {
                let re: Vec<u32> = missing
                    .iter()
                    .enumerate()
                    .filter(|(k, c)| mask & (1 << k) != 0 && c.index >= first)
                    .map(|(_, c)| c.index)
                    .collect();
                oracle = oracle.min(evaluate(&missing, &re, &m).unwrap().predicted.total);
            }
            let tol = 1e-9 * oracle.max(1.0);
            prop_assert!(
                (plan.predicted.total - oracle).abs() <= tol,
                "plan {} oracle {} {:?}", plan.predicted.total, oracle, plan
            );
        }
    }
}
