//! Counters and latency histograms of the pager's primitives, and the median every benchmark of
//! the workspace reports its samples by.

use std::cmp::Ordering;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// A latency histogram with power-of-two nanosecond buckets; lock-free to record.
#[derive(Debug)]
pub struct Histogram {
    buckets: [AtomicU64; 48],
    count: AtomicU64,
    sum_ns: AtomicU64,
    max_ns: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            count: AtomicU64::new(0),
            sum_ns: AtomicU64::new(0),
            max_ns: AtomicU64::new(0),
        }
    }
}

/// A histogram read out: count, mean and percentiles (bucket upper bounds), in nanoseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct HistogramSummary {
    /// Samples recorded.
    pub count: u64,
    /// Mean.
    pub mean_ns: u64,
    /// Median, to within a factor of two.
    pub p50_ns: u64,
    /// 99th percentile, to within a factor of two.
    pub p99_ns: u64,
    /// Largest sample.
    pub max_ns: u64,
}

impl Histogram {
    /// Record one sample.
    pub fn record(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let b = (64 - ns.leading_zeros() as usize).min(self.buckets.len() - 1);
        self.buckets[b].fetch_add(1, Relaxed);
        self.count.fetch_add(1, Relaxed);
        self.sum_ns.fetch_add(ns, Relaxed);
        self.max_ns.fetch_max(ns, Relaxed);
    }

    /// Read the histogram.
    pub fn summary(&self) -> HistogramSummary {
        let count = self.count.load(Relaxed);
        let max = self.max_ns.load(Relaxed);
        // A percentile is the upper bound of its power-of-two bucket, never above the largest
        // value seen (a bucket's bound can be).
        let pct = |p: f64| {
            let target = ((count as f64) * p).ceil().max(1.0) as u64;
            let mut seen = 0;
            for (i, b) in self.buckets.iter().enumerate() {
                seen += b.load(Relaxed);
                if seen >= target {
                    return if i == 0 { 0 } else { (1u64 << i).min(max) };
                }
            }
            max
        };
        HistogramSummary {
            count,
            mean_ns: self.sum_ns.load(Relaxed).checked_div(count).unwrap_or(0),
            p50_ns: if count == 0 { 0 } else { pct(0.5) },
            p99_ns: if count == 0 { 0 } else { pct(0.99) },
            max_ns: max,
        }
    }
}

/// A benchmark sample: a value with a total order ([`median`] sorts them).
pub trait Sample: Copy + Default {
    /// The total order of two samples (floats by `total_cmp`).
    fn total_cmp(&self, other: &Self) -> Ordering;
}

impl Sample for u64 {
    fn total_cmp(&self, other: &Self) -> Ordering {
        self.cmp(other)
    }
}

impl Sample for f64 {
    fn total_cmp(&self, other: &Self) -> Ordering {
        f64::total_cmp(self, other)
    }
}

/// The median of benchmark samples: the middle one, the upper of the two middle ones for an even
/// count, and zero for none. Every benchmark in the workspace reports its runs by it.
pub fn median<T: Sample>(samples: impl IntoIterator<Item = T>) -> T {
    let mut v: Vec<T> = samples.into_iter().collect();
    if v.is_empty() {
        return T::default();
    }
    let mid = v.len() / 2;
    *v.select_nth_unstable_by(mid, Sample::total_cmp).1
}

/// The pager's counters; shared by the API and the fault thread.
#[derive(Debug, Default)]
pub struct Stats {
    pub(crate) faults: AtomicU64,
    pub(crate) faults_woken: AtomicU64,
    pub(crate) faults_moved: AtomicU64,
    pub(crate) move_warmups: AtomicU64,
    pub(crate) populates: AtomicU64,
    pub(crate) reclaims: AtomicU64,
    pub(crate) unpersisted_reclaims: AtomicU64,
    pub(crate) sync_reclaims: AtomicU64,
    pub(crate) faults_deferred_for_room: AtomicU64,
    pub(crate) lock_waits: AtomicU64,
    pub(crate) shrinks: AtomicU64,
    pub(crate) bytes_in: AtomicU64,
    pub(crate) bytes_out: AtomicU64,
    pub(crate) source_errors: AtomicU64,
    pub(crate) recompute_requests: AtomicU64,
    pub(crate) budget_refusals: AtomicU64,
    pub(crate) eagain_retries: AtomicU64,
    pub(crate) fault_latency: Histogram,
    pub(crate) populate_latency: Histogram,
    pub(crate) reclaim_latency: Histogram,
    pub(crate) write_back_latency: Histogram,
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct StatsSnapshot {
    /// Page faults read from the userfaultfd.
    pub faults: u64,
    /// Faults on pages another path had already populated (only woken).
    pub faults_woken: u64,
    /// Faults resolved by UFFDIO_MOVE from the fault thread's warm buffer.
    pub faults_moved: u64,
    /// Times the fault thread finished faulting its move buffer in again (`PopulateVia::Move`):
    /// the next fault after one is resolved by UFFDIO_MOVE, unless another came first.
    pub move_warmups: u64,
    /// Chunks populated (claim, load or fault).
    pub populates: u64,
    /// Chunks reclaimed (explicitly or for room).
    pub reclaims: u64,
    /// Reclaims of chunks not written out: their bytes are gone until recomputed.
    pub unpersisted_reclaims: u64,
    /// Reclaims that waited for the source to write the victim out first
    /// ([`crate::ChunkSource::write_back`]).
    pub sync_reclaims: u64,
    /// Faults set aside until a victim's write-back made room (the fault thread never writes
    /// a victim itself: the pager's write-back thread does, and the fault is served after).
    pub faults_deferred_for_room: u64,
    /// Times locking or removing a context waited for one of its chunks' write-back to end.
    pub lock_waits: u64,
    /// Chunks shrunk in place.
    pub shrinks: u64,
    /// Bytes made resident.
    pub bytes_in: u64,
    /// Bytes given back to the kernel.
    pub bytes_out: u64,
    /// Source failures (missing, corrupt, I/O, timeout, panic).
    pub source_errors: u64,
    /// Chunks queued for recompute.
    pub recompute_requests: u64,
    /// Populates refused because nothing could be reclaimed.
    pub budget_refusals: u64,
    /// Ioctls retried after EAGAIN.
    pub eagain_retries: u64,
    /// Fault read to fault resolved, in the fault thread.
    pub fault_latency: HistogramSummary,
    /// One populate (copy or move), budget included.
    pub populate_latency: HistogramSummary,
    /// One chunk reclaim.
    pub reclaim_latency: HistogramSummary,
    /// One victim's write-back through the source, with the pager's lock released.
    pub write_back_latency: HistogramSummary,
}

impl Stats {
    /// Read every counter.
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            faults: self.faults.load(Relaxed),
            faults_woken: self.faults_woken.load(Relaxed),
            faults_moved: self.faults_moved.load(Relaxed),
            move_warmups: self.move_warmups.load(Relaxed),
            populates: self.populates.load(Relaxed),
            reclaims: self.reclaims.load(Relaxed),
            unpersisted_reclaims: self.unpersisted_reclaims.load(Relaxed),
            sync_reclaims: self.sync_reclaims.load(Relaxed),
            faults_deferred_for_room: self.faults_deferred_for_room.load(Relaxed),
            lock_waits: self.lock_waits.load(Relaxed),
            shrinks: self.shrinks.load(Relaxed),
            bytes_in: self.bytes_in.load(Relaxed),
            bytes_out: self.bytes_out.load(Relaxed),
            source_errors: self.source_errors.load(Relaxed),
            recompute_requests: self.recompute_requests.load(Relaxed),
            budget_refusals: self.budget_refusals.load(Relaxed),
            eagain_retries: self.eagain_retries.load(Relaxed),
            fault_latency: self.fault_latency.summary(),
            populate_latency: self.populate_latency.summary(),
            reclaim_latency: self.reclaim_latency.summary(),
            write_back_latency: self.write_back_latency.summary(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_never_exceed_the_largest_value() {
        let h = Histogram::default();
        for us in [1100u64, 1130, 900] {
            h.record(Duration::from_micros(us));
        }
        let s = h.summary();
        assert_eq!(s.max_ns, 1_130_000);
        assert!(s.p50_ns <= s.max_ns && s.p99_ns <= s.max_ns, "{s:?}");
        // 1.1 ms falls in the bucket that ends at 2^21 ns (2.1 ms): the bound is clamped.
        assert_eq!(s.p99_ns, s.max_ns);
    }

    #[test]
    fn the_median_is_the_middle_sample_or_the_upper_middle_one() {
        fn check<T: Sample + PartialEq + std::fmt::Debug>(samples: &[T], expected: T) {
            assert_eq!(median(samples.iter().copied()), expected, "{samples:?}");
        }
        check::<u64>(&[], 0);
        check(&[7u64], 7);
        check(&[3u64, 1, 2], 2);
        check(&[4u64, 1, 3, 2], 3);
        check::<f64>(&[], 0.0);
        check(&[0.5, -1.0, 2.0], 0.5);
        check(&[2.0, 1.0], 2.0);
        // A NaN sorts last instead of breaking the order.
        check(&[f64::NAN, 1.0, 3.0], 3.0);
    }
}
