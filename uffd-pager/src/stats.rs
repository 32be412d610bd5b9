//! Counters and latency histograms of the pager's primitives, and the median every benchmark of
//! the workspace reports its samples by.

use std::cmp::Ordering;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use parking_lot::Mutex;

/// A latency histogram: an HdrHistogram of nanoseconds (two significant digits, up to an hour;
/// longer samples count as an hour), with the exact sum and largest sample beside it. Its lock is
/// a leaf, held only while one sample is added or the histogram is read; its memory (about 36 KiB)
/// is fixed when it is made, so recording never allocates.
pub struct Histogram {
    inner: Mutex<Recorded>,
}

struct Recorded {
    hdr: hdrhistogram::Histogram<u64>,
    sum_ns: u64,
    max_ns: u64,
}

/// The largest sample the histogram tells apart: an hour.
const HIGHEST_NS: u64 = 3_600_000_000_000;

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            inner: Mutex::new(Recorded {
                hdr: hdrhistogram::Histogram::new_with_bounds(1, HIGHEST_NS, 2)
                    .expect("constant bounds are valid"),
                sum_ns: 0,
                max_ns: 0,
            }),
        }
    }
}

impl fmt::Debug for Histogram {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Histogram").field(&self.summary()).finish()
    }
}

/// A histogram read out: count, mean and percentiles, in nanoseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct HistogramSummary {
    /// Samples recorded.
    pub count: u64,
    /// Mean.
    pub mean_ns: u64,
    /// Median, to within 1%.
    pub p50_ns: u64,
    /// 99th percentile, to within 1%.
    pub p99_ns: u64,
    /// Largest sample.
    pub max_ns: u64,
}

impl Histogram {
    /// Record one sample.
    pub fn record(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let mut r = self.inner.lock();
        r.hdr.saturating_record(ns);
        r.sum_ns = r.sum_ns.saturating_add(ns);
        r.max_ns = r.max_ns.max(ns);
    }

    /// Read the histogram.
    pub fn summary(&self) -> HistogramSummary {
        let r = self.inner.lock();
        let count = r.hdr.len();
        // A percentile is the highest value of its HdrHistogram bucket, never above the largest
        // value seen (a bucket's highest value can be).
        let pct = |q: f64| {
            if count == 0 {
                0
            } else {
                r.hdr.value_at_quantile(q).min(r.max_ns)
            }
        };
        HistogramSummary {
            count,
            mean_ns: r.sum_ns.checked_div(count).unwrap_or(0),
            p50_ns: pct(0.5),
            p99_ns: pct(0.99),
            max_ns: r.max_ns,
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
        // 1.13 ms falls in a bucket whose highest value is above it: the bound is clamped.
        assert_eq!(s.p99_ns, s.max_ns);
    }

    #[test]
    fn percentiles_are_within_one_percent_and_the_mean_is_exact() {
        let h = Histogram::default();
        assert_eq!(h.summary(), HistogramSummary::default());
        // 1..=1000 us: the median is 500 us, the 99th percentile 990 us.
        for us in 1..=1000u64 {
            h.record(Duration::from_micros(us));
        }
        let s = h.summary();
        assert_eq!((s.count, s.mean_ns, s.max_ns), (1000, 500_500, 1_000_000));
        let near = |got: u64, want: u64| got >= want && got <= want + want / 100;
        assert!(near(s.p50_ns, 500_000) && near(s.p99_ns, 990_000), "{s:?}");
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
