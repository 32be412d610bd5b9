//! Which weight tensors stay resident under a weight budget and which are streamed per pass (FlexInfer: balanced locking, tensor preservation), with the stall it predicts.
//!
//! The pipeline model (docs/policy.md §8 says why):
//! - A pass (one decode token, or one prefill step) uses the tensors in their given order, each
//!   for `compute` seconds; passes repeat, so the reads of the next pass may start while this
//!   one computes.
//! - A streamed tensor is read by one I/O stream, in pass order, `reuse` times per pass, taking
//!   `latency + bytes / read_bps` per read, into one of `slots` buffers; a read needs a free
//!   buffer, and a buffer is freed when the tensor's compute ends. So the stream runs at most
//!   `slots` tensors ahead of the compute.
//! - A tensor's compute starts when the previous one's ends and, if streamed, its read is done.
//! - Memory: the resident tensors, plus `slots + staging` buffers of the largest streamed tensor
//!   (nothing when every tensor is resident), must fit the budget.
//!
//! The planner ([`Residency::Preserve`]) searches the balanced plans: for every tensor kind (its
//! place in a layer: the same kind has the same shape in every layer) a count of resident
//! copies, spread evenly over the layers with staggered phases so every layer streams about as
//! much; the counts are the preservation choice (big FFN tensors or many small attention ones).
//! It scores each by the simulated pass time, exactly over all counts (branch and bound on a
//! lower bound that only grows with streamed bytes), and also scores the in-order plan, so it is
//! never predicted slower than any other strategy here.

/// One weight tensor the engine can keep resident or stream.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WeightTensor {
    /// Its place in a layer; tensors of one kind should have one shape.
    pub kind: u32,
    /// Bytes it occupies resident or in a stream buffer.
    pub bytes: u64,
    /// Seconds of compute per pass that use it.
    pub compute: f64,
    /// Reads per pass when streamed (at least 1: used once per pass).
    pub reuse: u32,
}

/// How the engine streams.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StreamModel {
    /// Read bandwidth of the stream, bytes/s.
    pub read_bps: f64,
    /// Fixed seconds per read.
    pub latency: f64,
    /// Buffers the stream fills ahead of the compute (the prefetch window), at least 1.
    pub slots: usize,
    /// Further buffers of the largest streamed tensor's size the stream needs (staging).
    pub staging: usize,
    /// The staging buffers are taken in pages of this size when they come to at least half of
    /// one (direct reads run faster into huge pages), so they count rounded up to whole pages;
    /// 0: never.
    pub huge_page: u64,
}

impl StreamModel {
    fn read_secs(&self, t: &WeightTensor) -> f64 {
        f64::from(t.reuse.max(1)) * (self.latency + t.bytes as f64 / self.read_bps)
    }

    /// Bytes of stream buffers for a largest streamed tensor of `max_streamed` bytes.
    pub fn buffer_bytes(&self, max_streamed: u64) -> u64 {
        if max_streamed == 0 {
            return 0;
        }
        let staging = self.staging as u64 * max_streamed;
        let staging = if self.huge_page > 0 && 2 * staging >= self.huge_page {
            staging.next_multiple_of(self.huge_page)
        } else {
            staging
        };
        self.slots.max(1) as u64 * max_streamed + staging
    }
}

/// Which tensors to keep resident.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Residency {
    /// None: every tensor is streamed (prefetch only).
    Stream,
    /// In pass order while they fit: the first layers whole (locking without balance).
    InOrder,
    /// A share of every layer: kinds in their order, each in as many layers as fit, spread
    /// evenly (balanced locking without a preservation choice).
    Balanced,
    /// The balanced plan with the least predicted pass time over every count per kind
    /// (balanced locking and tensor preservation).
    Preserve,
}

/// What a plan is predicted to cost per pass.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PassPrediction {
    /// Seconds per pass in the steady state.
    pub pass_secs: f64,
    /// Seconds of compute per pass.
    pub compute_secs: f64,
    /// `pass_secs - compute_secs`: the compute waiting on reads.
    pub stall_secs: f64,
    /// Bytes read per pass.
    pub streamed_bytes: u64,
    /// Seconds per pass the stream needs on its own.
    pub read_secs: f64,
}

/// Which tensors stay resident, and what it is predicted to cost.
#[derive(Debug, Clone, PartialEq)]
pub struct WeightPlan {
    /// One flag per tensor, in the order given.
    pub resident: Vec<bool>,
    /// Bytes of the resident tensors.
    pub resident_bytes: u64,
    /// Bytes of the stream's buffers ([`StreamModel::buffer_bytes`]).
    pub buffer_bytes: u64,
    pub predicted: PassPrediction,
}

/// Why no plan fits.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum WeightPlanError {
    /// Even streaming every tensor needs more memory than the budget.
    #[error(
        "a weight budget of {budget} bytes is below the minimum working set of {minimum} bytes (stream buffers for every tensor)"
    )]
    BelowMinimum { budget: u64, minimum: u64 },
    /// A tensor or the stream is described with numbers the model cannot use.
    #[error("bad input: {what}")]
    Invalid { what: String },
}

fn check(tensors: &[WeightTensor], model: &StreamModel) -> Result<(), WeightPlanError> {
    let bad = |what: String| Err(WeightPlanError::Invalid { what });
    if !(model.read_bps > 0.0 && model.read_bps.is_finite()) {
        return bad(format!("read bandwidth {}", model.read_bps));
    }
    if !(model.latency >= 0.0 && model.latency.is_finite()) || model.slots == 0 {
        return bad(format!(
            "latency {} s, {} slots",
            model.latency, model.slots
        ));
    }
    if let Some((i, t)) = tensors
        .iter()
        .enumerate()
        .find(|(_, t)| !(t.compute >= 0.0 && t.compute.is_finite()) || t.reuse == 0)
    {
        return bad(format!(
            "tensor {i}: compute {} s, reuse {}",
            t.compute, t.reuse
        ));
    }
    Ok(())
}

/// Bytes of memory a plan needs: its resident tensors and the stream's buffers.
pub fn plan_bytes(tensors: &[WeightTensor], resident: &[bool], model: &StreamModel) -> u64 {
    let mut res = 0;
    let mut max_streamed = 0;
    for (t, &r) in tensors.iter().zip(resident) {
        if r {
            res += t.bytes;
        } else {
            max_streamed = max_streamed.max(t.bytes);
        }
    }
    res + model.buffer_bytes(max_streamed)
}

/// The least budget any plan fits: everything streamed, or everything resident if less.
pub fn min_budget(tensors: &[WeightTensor], model: &StreamModel) -> u64 {
    let all = vec![false; tensors.len()];
    plan_bytes(tensors, &all, model).min(tensors.iter().map(|t| t.bytes).sum())
}

/// Passes simulated to reach the steady state; the last one is measured.
const PASSES: usize = 4;

/// The steady-state cost of one pass with the `resident` tensors kept and the rest streamed.
pub fn predict(tensors: &[WeightTensor], resident: &[bool], model: &StreamModel) -> PassPrediction {
    let compute_secs: f64 = tensors.iter().map(|t| t.compute).sum();
    let mut streamed_bytes = 0;
    let mut read_secs = 0.0;
    for (t, _) in tensors.iter().zip(resident).filter(|(_, r)| !**r) {
        streamed_bytes += t.bytes * u64::from(t.reuse.max(1));
        read_secs += model.read_secs(t);
    }
    // Compute end of every streamed read so far (global order), to free its buffer.
    let slots = model.slots.max(1);
    let mut freed: std::collections::VecDeque<f64> = std::collections::VecDeque::new();
    let (mut io_free, mut done) = (0.0f64, 0.0f64);
    let mut pass_start = 0.0;
    for _ in 0..PASSES {
        pass_start = done;
        for (t, &r) in tensors.iter().zip(resident) {
            let ready = if r {
                0.0
            } else {
                // A buffer frees when the tensor `slots` reads back has been computed.
                let buffer = if freed.len() >= slots {
                    freed.pop_front().unwrap_or(0.0)
                } else {
                    0.0
                };
                io_free = io_free.max(buffer) + model.read_secs(t);
                io_free
            };
            done = done.max(ready) + t.compute;
            if !r {
                freed.push_back(done);
            }
        }
    }
    let pass_secs = done - pass_start;
    PassPrediction {
        pass_secs,
        compute_secs,
        stall_secs: (pass_secs - compute_secs).max(0.0),
        streamed_bytes,
        read_secs,
    }
}

/// The positions of `n` of `len` instances, evenly spaced, shifted by `phase` (0 to 1) of a gap.
fn spread(len: usize, n: usize, phase: f64) -> impl Iterator<Item = usize> {
    (0..n).map(move |j| (((j as f64 + phase) * len as f64 / n as f64) as usize).min(len - 1))
}

/// Tensors grouped by kind: each kind's tensor indices in pass order, kinds by first use.
fn kinds(tensors: &[WeightTensor]) -> Vec<Vec<usize>> {
    let mut order: Vec<u32> = Vec::new();
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        match order.iter().position(|&k| k == t.kind) {
            Some(g) => groups[g].push(i),
            None => {
                order.push(t.kind);
                groups.push(vec![i]);
            }
        }
    }
    groups
}

/// The resident flags of a balanced plan with `counts[g]` copies of kind group `g`.
fn balanced(tensors: &[WeightTensor], groups: &[Vec<usize>], counts: &[usize]) -> Vec<bool> {
    let mut resident = vec![false; tensors.len()];
    let k = groups.len();
    for (g, (members, &n)) in groups.iter().zip(counts).enumerate() {
        if n == 0 {
            continue;
        }
        // Staggered phases: kind g's copies sit g/k of a gap after kind 0's.
        for p in spread(members.len(), n, (g as f64 + 0.5) / k as f64) {
            resident[members[p]] = true;
        }
    }
    resident
}

/// Plans which tensors stay resident under `budget` bytes with `strategy`.
pub fn plan_weights(
    tensors: &[WeightTensor],
    budget: u64,
    model: &StreamModel,
    strategy: Residency,
) -> Result<WeightPlan, WeightPlanError> {
    check(tensors, model)?;
    let minimum = min_budget(tensors, model);
    if budget < minimum {
        return Err(WeightPlanError::BelowMinimum { budget, minimum });
    }
    let total: u64 = tensors.iter().map(|t| t.bytes).sum();
    let resident = if total <= budget {
        vec![true; tensors.len()]
    } else {
        match strategy {
            Residency::Stream => vec![false; tensors.len()],
            Residency::InOrder => in_order(tensors, budget, model),
            Residency::Balanced => {
                let groups = kinds(tensors);
                let counts = greedy_counts(tensors, &groups, budget, model);
                balanced(tensors, &groups, &counts)
            }
            Residency::Preserve => preserve(tensors, budget, model),
        }
    };
    Ok(finish(tensors, resident, model))
}

fn finish(tensors: &[WeightTensor], resident: Vec<bool>, model: &StreamModel) -> WeightPlan {
    let resident_bytes = tensors
        .iter()
        .zip(&resident)
        .filter(|(_, r)| **r)
        .map(|(t, _)| t.bytes)
        .sum();
    let max_streamed = tensors
        .iter()
        .zip(&resident)
        .filter(|(_, r)| !**r)
        .map(|(t, _)| t.bytes)
        .max()
        .unwrap_or(0);
    WeightPlan {
        predicted: predict(tensors, &resident, model),
        resident,
        resident_bytes,
        buffer_bytes: model.buffer_bytes(max_streamed),
    }
}

/// Tensors in pass order while they fit (a tensor that does not fit is skipped).
fn in_order(tensors: &[WeightTensor], budget: u64, model: &StreamModel) -> Vec<bool> {
    let mut resident = vec![false; tensors.len()];
    for i in 0..tensors.len() {
        resident[i] = true;
        if plan_bytes(tensors, &resident, model) > budget {
            resident[i] = false;
        }
    }
    resident
}

/// Counts per kind group, first group first, each as many as fit.
fn greedy_counts(
    tensors: &[WeightTensor],
    groups: &[Vec<usize>],
    budget: u64,
    model: &StreamModel,
) -> Vec<usize> {
    let mut counts = vec![0; groups.len()];
    for g in 0..groups.len() {
        while counts[g] < groups[g].len() {
            counts[g] += 1;
            if plan_bytes(tensors, &balanced(tensors, groups, &counts), model) > budget {
                counts[g] -= 1;
                break;
            }
        }
    }
    counts
}

/// The search of [`Residency::Preserve`].
struct Search<'a> {
    tensors: &'a [WeightTensor],
    groups: Vec<Vec<usize>>,
    budget: u64,
    model: &'a StreamModel,
    compute: f64,
    best: Option<(f64, Vec<bool>)>,
    counts: Vec<usize>,
    /// Whether to prune by the lower bound (off only in the tests' oracle).
    prune: bool,
}

impl Search<'_> {
    fn consider(&mut self, resident: Vec<bool>) {
        if plan_bytes(self.tensors, &resident, self.model) > self.budget {
            return;
        }
        let p = predict(self.tensors, &resident, self.model).pass_secs;
        if self.best.as_ref().is_none_or(|(b, _)| p < *b) {
            self.best = Some((p, resident));
        }
    }

    /// Tries every count of group `g` and of the groups after it.
    fn walk(&mut self, g: usize) {
        if g == self.groups.len() {
            let resident = balanced(self.tensors, &self.groups, &self.counts);
            self.consider(resident);
            return;
        }
        // Most copies first: plans that stream less come first and set a good bound early.
        for n in (0..=self.groups[g].len()).rev() {
            self.counts[g] = n;
            // Resident bytes of the counts so far; later groups add none in the bound.
            let res: u64 = self
                .groups
                .iter()
                .zip(&self.counts)
                .take(g + 1)
                .map(|(m, &c)| c as u64 * self.tensors[m[0]].bytes)
                .sum();
            if res > self.budget {
                continue;
            }
            if self.prune && self.bound(g) >= self.best.as_ref().map_or(f64::INFINITY, |b| b.0) {
                // Fewer copies of this group only stream more.
                break;
            }
            self.walk(g + 1);
        }
        self.counts[g] = 0;
    }

    /// A lower bound on the pass time of any plan with `counts[..=g]` fixed: the compute, and
    /// the reads of the streamed copies of groups `..=g` plus what the rest of the budget cannot
    /// hold of groups after `g`.
    fn bound(&self, g: usize) -> f64 {
        let mut read = 0.0;
        let mut res = 0u64;
        for (m, &c) in self.groups.iter().zip(&self.counts).take(g + 1) {
            res += c as u64 * self.tensors[m[0]].bytes;
            // Streamed copies: the group's members past its count; any c of them cost the same
            // in bytes when the kind has one shape, and the least otherwise.
            let mut reads: Vec<f64> = m
                .iter()
                .map(|&i| self.model.read_secs(&self.tensors[i]))
                .collect();
            reads.sort_by(f64::total_cmp);
            read += reads[..m.len() - c].iter().sum::<f64>();
        }
        // Groups after g: at best the room left holds their tensors with the most read time per
        // byte (a fractional knapsack bound).
        let mut rest: Vec<(f64, u64)> = self.groups[g + 1..]
            .iter()
            .flatten()
            .map(|&i| {
                (
                    self.model.read_secs(&self.tensors[i]),
                    self.tensors[i].bytes,
                )
            })
            .collect();
        rest.sort_by(|a, b| (b.0 / b.1.max(1) as f64).total_cmp(&(a.0 / a.1.max(1) as f64)));
        let mut room = self.budget.saturating_sub(res) as f64;
        for (secs, bytes) in rest {
            let keep = (room / bytes.max(1) as f64).min(1.0);
            read += secs * (1.0 - keep);
            room -= keep * bytes as f64;
        }
        self.compute.max(read)
    }
}

/// The best balanced plan, or the in-order plan if it is predicted faster.
fn preserve(tensors: &[WeightTensor], budget: u64, model: &StreamModel) -> Vec<bool> {
    search(tensors, budget, model, true)
}

fn search(tensors: &[WeightTensor], budget: u64, model: &StreamModel, prune: bool) -> Vec<bool> {
    let groups = kinds(tensors);
    let mut s = Search {
        tensors,
        counts: vec![0; groups.len()],
        groups,
        budget,
        model,
        compute: tensors.iter().map(|t| t.compute).sum(),
        best: None,
        prune,
    };
    s.consider(in_order(tensors, budget, model));
    s.walk(0);
    s.best.map_or_else(|| vec![false; tensors.len()], |b| b.1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn model(read_bps: f64, slots: usize) -> StreamModel {
        StreamModel {
            read_bps,
            latency: 0.0,
            slots,
            staging: 0,
            huge_page: 0,
        }
    }

    #[test]
    fn staging_counts_whole_huge_pages_from_half_of_one() {
        let m = StreamModel {
            staging: 2,
            huge_page: 64,
            ..model(1.0, 2)
        };
        assert_eq!(m.buffer_bytes(0), 0);
        // 2 slots of 10 bytes, staging 20 bytes: below half a page, as it is.
        assert_eq!(m.buffer_bytes(10), 20 + 20);
        // Staging 32 bytes (half a page) and 70 bytes: one and two whole pages.
        assert_eq!(m.buffer_bytes(16), 32 + 64);
        assert_eq!(m.buffer_bytes(35), 70 + 128);
        let none = StreamModel { huge_page: 0, ..m };
        assert_eq!(none.buffer_bytes(35), 70 + 70);
    }

    fn t(kind: u32, bytes: u64, compute: f64) -> WeightTensor {
        WeightTensor {
            kind,
            bytes,
            compute,
            reuse: 1,
        }
    }

    /// Layers of the given kinds' (bytes, compute), repeated.
    fn layers(n: usize, kinds: &[(u64, f64)]) -> Vec<WeightTensor> {
        (0..n)
            .flat_map(|_| {
                kinds
                    .iter()
                    .enumerate()
                    .map(|(k, &(b, c))| t(k as u32, b, c))
            })
            .collect()
    }

    fn check_pass(tensors: &[WeightTensor], resident: &[bool], m: StreamModel, expected: f64) {
        let p = predict(tensors, resident, &m);
        assert!(
            (p.pass_secs - expected).abs() < 1e-9,
            "{resident:?}: predicted {} s, expected {expected} s",
            p.pass_secs
        );
    }

    #[test]
    fn predicts_the_pipeline() {
        let ts = layers(3, &[(10, 1.0), (30, 2.0)]);
        let all = [true; 6];
        let none = [false; 6];
        // All resident: the compute alone.
        check_pass(&ts, &all, model(1.0, 1), 9.0);
        // Slow reads, everything streamed: the reads alone (120 bytes at 1 B/s).
        check_pass(&ts, &none, model(1.0, 3), 120.0);
        // Fast reads with a window: reads hide behind the compute.
        check_pass(&ts, &none, model(1000.0, 3), 9.0);
        // One slot: each read waits for the previous tensor's compute, nothing overlaps
        // within a pass except the next read with nothing: 9 s compute + 120/100 s of reads.
        check_pass(&ts, &none, model(100.0, 1), 9.0 + 1.2);
        // Half streamed at 10 B/s: 60 bytes = 6 s of reads hide in 9 s of compute.
        let half = [true, false, true, false, true, false];
        check_pass(&ts, &half, model(10.0, 2), 9.0);
    }

    #[test]
    fn uneven_locking_stalls_where_balanced_does_not() {
        // 4 layers of one 10-byte tensor, 1 s compute each, reads 1 s each, one slot ahead.
        let ts = layers(4, &[(10, 1.0)]);
        let m = model(10.0, 1);
        // The first two resident: the stream idles while they compute, then both streamed
        // layers wait for their reads.
        let front = predict(&ts, &[true, true, false, false], &m);
        let spread = predict(&ts, &[true, false, true, false], &m);
        assert_eq!(spread.pass_secs, 4.0);
        assert!(front.pass_secs > spread.pass_secs, "{front:?}");
    }

    #[test]
    fn budget_below_the_working_set_is_refused() {
        let ts = layers(2, &[(10, 1.0), (30, 1.0)]);
        let m = StreamModel {
            staging: 1,
            ..model(1.0, 2)
        };
        // Streaming all needs three buffers of the 30-byte tensor (90 bytes): holding all (80)
        // is the least.
        assert_eq!(min_budget(&ts, &m), 80);
        assert_eq!(
            plan_weights(&ts, 79, &m, Residency::Preserve),
            Err(WeightPlanError::BelowMinimum {
                budget: 79,
                minimum: 80
            })
        );
        let all = plan_weights(&ts, 80, &m, Residency::Stream).unwrap();
        assert_eq!(all.resident, vec![true; 4]);
        assert_eq!(all.buffer_bytes, 0);
    }

    #[test]
    fn strategies_differ_as_named() {
        let ts = layers(4, &[(10, 0.1), (30, 0.1)]);
        let m = model(10.0, 2);
        let plan = |s| plan_weights(&ts, 100, &m, s).unwrap().resident;
        assert_eq!(plan(Residency::Stream), vec![false; 8]);
        // 2 buffers of 30 bytes: 40 bytes left, in order: layer 0 whole.
        assert_eq!(
            plan(Residency::InOrder),
            [true, true, false, false, false, false, false, false]
        );
        // Kind 0 first: all four 10-byte tensors.
        assert_eq!(
            plan(Residency::Balanced),
            [true, false, true, false, true, false, true, false]
        );
    }

    #[test]
    fn invalid_input_is_an_error() {
        let ts = layers(1, &[(10, 1.0)]);
        for m in [model(0.0, 1), model(f64::NAN, 1), model(1.0, 0)] {
            assert!(matches!(
                plan_weights(&ts, 100, &m, Residency::Preserve),
                Err(WeightPlanError::Invalid { .. })
            ));
        }
        let bad = [WeightTensor { reuse: 0, ..ts[0] }];
        assert!(plan_weights(&bad, 100, &model(1.0, 1), Residency::Preserve).is_err());
    }

    fn arb_case() -> impl proptest::strategy::Strategy<Value = (Vec<WeightTensor>, StreamModel, u64)>
    {
        (
            1usize..4,
            prop::collection::vec((1u64..40, 0.0f64..3.0), 1..4),
            prop::collection::vec((1u64..60, 0.0f64..3.0), 0..3),
            0.5f64..40.0,
            1usize..4,
            0usize..2,
            0.0f64..1.0,
            prop::sample::select(vec![0u64, 16, 64]),
        )
            .prop_map(|(l, kinds, head, bps, slots, staging, frac, huge_page)| {
                let mut ts = layers(l, &kinds);
                ts.extend(head.iter().map(|&(b, c)| t(9, b, c)));
                let m = StreamModel {
                    read_bps: bps,
                    latency: 0.0,
                    slots,
                    staging,
                    huge_page,
                };
                let total: u64 = ts.iter().map(|t| t.bytes).sum();
                let lo = min_budget(&ts, &m);
                let budget = lo + ((total.saturating_sub(lo)) as f64 * frac) as u64;
                (ts, m, budget)
            })
    }

    proptest! {
        #[test]
        fn preserve_fits_and_is_never_predicted_slower((ts, m, budget) in arb_case()) {
            let best = plan_weights(&ts, budget, &m, Residency::Preserve).unwrap();
            prop_assert!(plan_bytes(&ts, &best.resident, &m) <= budget);
            prop_assert_eq!(best.resident_bytes + best.buffer_bytes, plan_bytes(&ts, &best.resident, &m));
            for s in [Residency::Stream, Residency::InOrder, Residency::Balanced] {
                let other = plan_weights(&ts, budget, &m, s).unwrap();
                prop_assert!(plan_bytes(&ts, &other.resident, &m) <= budget, "{:?}", s);
                prop_assert!(
                    best.predicted.pass_secs <= other.predicted.pass_secs + 1e-9,
                    "{:?} {:?} beats {:?}", s, other.predicted, best.predicted
                );
            }
        }

        #[test]
        fn pruning_loses_nothing((ts, m, budget) in arb_case()) {
            let fast = predict(&ts, &search(&ts, budget, &m, true), &m).pass_secs;
            let full = predict(&ts, &search(&ts, budget, &m, false), &m).pass_secs;
            prop_assert!((fast - full).abs() < 1e-9, "pruned {} vs full {}", fast, full);
        }

        #[test]
        fn close_to_every_subset((ts, m, budget) in arb_case()) {
            let best = plan_weights(&ts, budget, &m, Residency::Preserve).unwrap();
            let mut oracle = f64::INFINITY;
            for mask in 0u32..(1 << ts.len()) {
                let r: Vec<bool> = (0..ts.len()).map(|i| mask >> i & 1 == 1).collect();
                if plan_bytes(&ts, &r, &m) <= budget {
                    oracle = oracle.min(predict(&ts, &r, &m).pass_secs);
                }
            }
            // The balanced family chooses how many tensors of each kind stay, not which layers
            // hold them, so it may miss the best subset: by up to one read of each kind (one
            // read in all was claimed before and is false: a two-layer case with two kinds and
            // a head missed it by 13%).
            let mut worst = std::collections::BTreeMap::new();
            for t in &ts {
                let w = worst.entry(t.kind).or_insert(0.0f64);
                *w = w.max(m.read_secs(t));
            }
            let slack: f64 = worst.values().sum();
            prop_assert!(best.predicted.pass_secs >= oracle - 1e-9);
            prop_assert!(
                best.predicted.pass_secs <= oracle + slack + 1e-9,
                "planner {} vs best subset {}", best.predicted.pass_secs, oracle
            );
        }
    }
}
