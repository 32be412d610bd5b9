//! Criterion benchmarks of the policy crate: planner, assignment and victim-chooser operations at 100, 1,000 and 10,000 chunks.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use policy::{
    ChunkId, ChunkLru, CostModel, LctruQueue, Level, LevelSet, LinearCost, MissingChunk,
    VictimChooser, WholeContextLru, assign_levels, plan_load, plan_order_blind,
};

const SIZES: [usize; 3] = [100, 1_000, 10_000];

/// SmolLM2-135M's int8 chunk: 30 layers, K and V, 3 KV heads of 64, 16 tokens.
const INT8_CHUNK: u64 = 30 * 2 * 3 * 64 * 16;

/// A small deterministic generator, so runs compare.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

fn missing(n: usize) -> Vec<MissingChunk> {
    let mut rng = Lcg(7);
    (0..n)
        .map(|i| MissingChunk {
            index: i as u32 * 2,
            bytes: INT8_CHUNK >> (rng.next() % 3),
        })
        .collect()
}

fn model() -> CostModel {
    // 1 GB/s after 100 us, 5 ms a chunk after 10 ms.
    CostModel::new(
        LinearCost::new(0.010, 0.005).unwrap(),
        LinearCost::new(0.0001, 1e-9).unwrap(),
    )
}

fn planner(c: &mut Criterion) {
    let mut g = c.benchmark_group("planner");
    let m = model();
    for n in SIZES {
        let chunks = missing(n);
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::new("plan_load", n), &chunks, |b, ch| {
            b.iter(|| plan_load(black_box(ch), &m).unwrap())
        });
        g.bench_with_input(BenchmarkId::new("plan_order_blind", n), &chunks, |b, ch| {
            b.iter(|| plan_order_blind(black_box(ch), &m).unwrap())
        });
    }
    g.finish();
}

fn assign(c: &mut Criterion) {
    let mut g = c.benchmark_group("assign");
    let set = LevelSet::default();
    for n in SIZES {
        let mut rng = Lcg(11);
        let d: Vec<f64> = (0..n).map(|_| rng.next() as f64 / 2e9).collect();
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::new("assign_levels", n), &d, |b, d| {
            b.iter(|| assign_levels(black_box(d), None, &set, 0.5).unwrap())
        });
    }
    g.finish();
}

/// Fills `q` with `n` chunks over `n / 50` contexts.
fn fill(q: &mut dyn VictimChooser, n: usize) -> Vec<ChunkId> {
    let mut rng = Lcg(3);
    let ids: Vec<ChunkId> = (0..n)
        .map(|i| ChunkId::new((i / 50) as u64, (i % 50) as u32))
        .collect();
    for &id in &ids {
        let level = Level((rng.next() % 3) as u8);
        q.on_insert(id, level, INT8_CHUNK >> level.0).unwrap();
    }
    ids
}

/// One access, then one pop of at least a byte, its victims reinserted: the size stays `n`
/// (a whole-context chooser pops and reinserts a whole context).
fn churn(q: &mut dyn VictimChooser, ids: &[ChunkId], rng: &mut Lcg) {
    let id = ids[(rng.next() as usize) % ids.len()];
    q.on_access(id).unwrap();
    let v = q.pop_victims(1);
    for victim in v.chunks {
        let level = Level((rng.next() % 3) as u8);
        q.on_insert(victim.id, level, INT8_CHUNK >> level.0)
            .unwrap();
    }
}

type MakeChooser = fn() -> Box<dyn VictimChooser>;

fn queues(c: &mut Criterion) {
    let mut g = c.benchmark_group("victims");
    for n in SIZES {
        let makers: [(&str, MakeChooser); 3] = [
            ("lctru", || Box::new(LctruQueue::new())),
            ("chunk_lru", || Box::new(ChunkLru::new())),
            (
                "whole_context_lru",
                || Box::new(WholeContextLru::swapping()),
            ),
        ];
        for (name, make) in makers {
            let mut q = make();
            let ids = fill(q.as_mut(), n);
            let mut rng = Lcg(5);
            g.bench_function(BenchmarkId::new(name, n), |b| {
                b.iter(|| churn(q.as_mut(), &ids, &mut rng))
            });
        }
        // Locking and unlocking one 50-chunk context (a call's start and end).
        let mut q = LctruQueue::new();
        fill(&mut q, n);
        let mut ctx = 0u64;
        let contexts = (n / 50).max(1) as u64;
        g.bench_function(BenchmarkId::new("lctru_lock_unlock", n), |b| {
            b.iter(|| {
                ctx = (ctx + 1) % contexts;
                q.lock(ctx);
                q.unlock(ctx).unwrap();
            })
        });
    }
    g.finish();
}

criterion_group!(benches, planner, assign, queues);
criterion_main!(benches);
