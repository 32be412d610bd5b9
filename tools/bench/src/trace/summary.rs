//! What a trace holds, for `llms trace show`: counts, lengths, arrivals and how often and how
//! far calls switch between contexts.

use serde::Serialize;

use super::{PastCap, Source, Trace, TraceHeader, TraceRow};

/// Minimum, mean and maximum of some numbers (all 0 when there are none).
#[derive(Serialize, Debug, Clone, Copy, PartialEq, Default)]
pub struct Stats {
    pub min: f64,
    pub mean: f64,
    pub max: f64,
}

impl Stats {
    /// The stats of `xs`.
    pub fn of(xs: impl IntoIterator<Item = f64>) -> Stats {
        let (mut n, mut sum, mut min, mut max) = (0usize, 0.0, f64::INFINITY, f64::NEG_INFINITY);
        for x in xs {
            n += 1;
            sum += x;
            min = min.min(x);
            max = max.max(x);
        }
        if n == 0 {
            return Stats::default();
        }
        Stats {
            min,
            mean: sum / n as f64,
            max,
        }
    }
}

/// Counts of a distance, by bucket.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct Histogram {
    /// Bucket labels: `0`, `1`, `2`, `3`, `4-7`, `8+`.
    pub buckets: Vec<String>,
    /// Calls per bucket.
    pub counts: Vec<u64>,
}

/// One context of a trace, summed up.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct ContextSummary {
    pub context: u32,
    pub app: String,
    pub source: Source,
    /// Calls to it.
    pub calls: u64,
    /// Its share of all calls.
    pub share: f64,
    /// Calls that start its conversation (the first, and each restart).
    pub starts: u64,
    /// Calls after which it holds more than `max_context` tokens (the service slides).
    pub past_cap: u64,
    /// Prompt tokens per call.
    pub tokens: Stats,
    /// Tokens appended to it over the trace: prompts and answers' `max_tokens`, restarts and
    /// slides notwithstanding.
    pub appended_tokens: u64,
    /// What it holds after its last call (upper bound): `context_tokens`, at most
    /// `max_context`; 0 if never called.
    pub final_tokens: u64,
}

/// One source of a trace, summed up, against its Table 3 range.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct SourceSummary {
    pub source: Source,
    /// Table 3's range of prompt tokens per call.
    pub range: (u32, u32),
    pub contexts: u32,
    pub calls: u64,
    pub tokens: Stats,
}

/// Everything `llms trace show` reports.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct Summary {
    pub calls: u64,
    pub contexts: u32,
    pub seed: u64,
    pub pattern: super::Pattern,
    pub max_context: u32,
    pub past_cap: PastCap,
    /// Time of the last call, seconds.
    pub duration_s: f64,
    /// The header's mean arrival rate, calls per second.
    pub rate: f64,
    /// Calls per second over the trace (calls ÷ duration).
    pub measured_rate: f64,
    /// Seconds between consecutive calls (the first from time 0).
    pub interarrival_s: Stats,
    /// Their coefficient of variation (1 for a Poisson process).
    pub interarrival_cv: f64,
    /// Prompt tokens over all calls.
    pub prompt_tokens: u64,
    /// Fraction of calls (after the first) to another context than the previous call's.
    pub switch_fraction: f64,
    /// Per call to an already-called context: how many distinct other contexts were called
    /// since its previous call (0: no switch). First calls are not counted.
    pub reuse_distance: Histogram,
    /// Mean of those reuse distances.
    pub mean_reuse_distance: f64,
    /// Contexts called at least once.
    pub contexts_called: u32,
    pub per_context: Vec<ContextSummary>,
    pub per_source: Vec<SourceSummary>,
}

const BUCKETS: [&str; 6] = ["0", "1", "2", "3", "4-7", "8+"];

fn bucket(d: usize) -> usize {
    match d {
        0..=3 => d,
        4..=7 => 4,
        _ => 5,
    }
}

impl Summary {
    /// Sums up `trace`.
    pub fn of(trace: &Trace) -> Summary {
        let h = &trace.header;
        let rows = &trace.rows;
        let n = rows.len() as u64;
        let duration = rows.last().map_or(0.0, |r| r.time);
        let (gap_stats, cv) = interarrival(rows);
        let switching = Switching::of(rows);
        let per_context = per_context(h, rows);
        Summary {
            calls: n,
            contexts: h.contexts.len() as u32,
            seed: h.seed,
            pattern: h.pattern,
            max_context: h.max_context,
            past_cap: h.past_cap,
            duration_s: duration,
            rate: h.rate,
            measured_rate: if duration > 0.0 {
                n as f64 / duration
            } else {
                0.0
            },
            interarrival_s: gap_stats,
            interarrival_cv: cv,
            prompt_tokens: rows.iter().map(|r| u64::from(r.tokens)).sum(),
            switch_fraction: if n > 1 {
                switching.switches as f64 / (n - 1) as f64
            } else {
                0.0
            },
            reuse_distance: Histogram {
                buckets: BUCKETS.iter().map(|b| b.to_string()).collect(),
                counts: switching.counts,
            },
            mean_reuse_distance: if switching.reuses > 0 {
                switching.reuse_sum as f64 / switching.reuses as f64
            } else {
                0.0
            },
            contexts_called: per_context.iter().filter(|c| c.calls > 0).count() as u32,
            per_context,
            per_source: per_source(h, rows),
        }
    }
}

/// The stats of the seconds between consecutive calls (the first from time 0), and their
/// coefficient of variation.
fn interarrival(rows: &[TraceRow]) -> (Stats, f64) {
    let gaps: Vec<f64> = rows
        .iter()
        .scan(0.0, |prev, r| {
            let g = r.time - *prev;
            *prev = r.time;
            Some(g)
        })
        .collect();
    let gap_stats = Stats::of(gaps.iter().copied());
    let var = if gaps.len() > 1 {
        gaps.iter()
            .map(|g| (g - gap_stats.mean).powi(2))
            .sum::<f64>()
            / (gaps.len() - 1) as f64
    } else {
        0.0
    };
    let cv = if gap_stats.mean > 0.0 {
        var.sqrt() / gap_stats.mean
    } else {
        0.0
    };
    (gap_stats, cv)
}

/// How the calls switch contexts.
struct Switching {
    /// Calls (after the first) to another context than the previous call's.
    switches: u64,
    /// Reuse distances by bucket of [`BUCKETS`].
    counts: Vec<u64>,
    /// The reuse distances' sum, and how many there were (calls to an already-called context).
    reuse_sum: u64,
    reuses: u64,
}

impl Switching {
    /// The switches and reuse distances of `rows`: per call to an already-called context, how
    /// many distinct other contexts were called since its previous call.
    fn of(rows: &[TraceRow]) -> Switching {
        let mut counts = vec![0u64; BUCKETS.len()];
        let (mut switches, mut reuse_sum, mut reuses) = (0u64, 0u64, 0u64);
        // Contexts, most recently called first (LRU stack).
        let mut stack: Vec<u32> = Vec::new();
        for (i, r) in rows.iter().enumerate() {
            if i > 0 && rows[i - 1].context != r.context {
                switches += 1;
            }
            if let Some(d) = stack.iter().position(|&c| c == r.context) {
                counts[bucket(d)] += 1;
                reuse_sum += d as u64;
                reuses += 1;
                stack.remove(d);
            }
            stack.insert(0, r.context);
        }
        Switching {
            switches,
            counts,
            reuse_sum,
            reuses,
        }
    }
}

/// Each context of the header, summed up over `rows`.
fn per_context(h: &TraceHeader, rows: &[TraceRow]) -> Vec<ContextSummary> {
    let n = rows.len() as u64;
    let mut per_context: Vec<ContextSummary> = h
        .contexts
        .iter()
        .map(|c| ContextSummary {
            context: c.context,
            app: c.app.clone(),
            source: c.source,
            calls: 0,
            share: 0.0,
            starts: 0,
            past_cap: 0,
            tokens: Stats::default(),
            appended_tokens: 0,
            final_tokens: 0,
        })
        .collect();
    for r in rows {
        let c = &mut per_context[r.context as usize];
        c.calls += 1;
        c.starts += u64::from(r.start);
        c.past_cap += u64::from(r.context_tokens > u64::from(h.max_context));
        c.appended_tokens += u64::from(r.tokens + r.max_tokens);
        c.final_tokens = r.context_tokens.min(u64::from(h.max_context));
    }
    for c in &mut per_context {
        c.share = if n > 0 {
            c.calls as f64 / n as f64
        } else {
            0.0
        };
        c.tokens = Stats::of(
            rows.iter()
                .filter(|r| r.context == c.context)
                .map(|r| f64::from(r.tokens)),
        );
    }
    per_context
}

/// Each source of the header's contexts, summed up over `rows`, in order.
fn per_source(h: &TraceHeader, rows: &[TraceRow]) -> Vec<SourceSummary> {
    let mut sources: Vec<Source> = h.contexts.iter().map(|c| c.source).collect();
    sources.sort();
    sources.dedup();
    sources
        .into_iter()
        .map(|s| SourceSummary {
            source: s,
            range: s.delta(),
            contexts: h.contexts.iter().filter(|c| c.source == s).count() as u32,
            calls: rows.iter().filter(|r| r.source == s).count() as u64,
            tokens: Stats::of(
                rows.iter()
                    .filter(|r| r.source == s)
                    .map(|r| f64::from(r.tokens)),
            ),
        })
        .collect()
}
