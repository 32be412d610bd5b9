//! The end of a call's Compress step: sealed int8 chunks of SmolLM2-135M's shape (30 layers,
//! 3 KV heads of 64, 16 tokens) moved down to k8v8, k4v4 and k4v3, one chunk alone
//! (`codec::recompress`), and 128 chunks one after another or in parallel batches
//! (`KvCache::recompress_many`), as a long pasted document's chunks are at its call's end.

use std::hint::black_box;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use model::kv::codec::{self, ChunkShape};
use model::kv::{HeapChunks, KvCache, KvFormat};

const SHAPE: ChunkShape = ChunkShape {
    n_layers: 30,
    n_kv_heads: 3,
    head_dim: 64,
    tokens: 16,
    ..ChunkShape::DENSE
};

/// One int8 chunk of smooth values with a few large channels, as keys have.
fn chunk(seed: usize) -> Vec<u8> {
    let n = SHAPE.section();
    let val = |i: usize| {
        let x = ((i * 7919 + seed * 104_729) % 2003) as f32 / 1001.0 - 1.0;
        if i % 64 == 5 { 8.0 * x } else { x }
    };
    let k: Vec<f32> = (0..n).map(val).collect();
    let v: Vec<f32> = (0..n).map(|i| val(i + 17)).collect();
    let lb = SHAPE.layer_bytes(KvFormat::Int8);
    let mut out = vec![0u8; SHAPE.chunk_bytes(KvFormat::Int8)];
    for l in 0..SHAPE.n_layers {
        codec::encode_layer(
            &SHAPE,
            KvFormat::Int8,
            &k,
            &v,
            &mut out[l * lb..(l + 1) * lb],
        )
        .unwrap();
    }
    out
}

fn cache(chunks: &[Vec<u8>]) -> KvCache {
    let n = chunks.len();
    let tokens: Vec<u32> = (0..(n * SHAPE.tokens) as u32).collect();
    let mut c = KvCache::resume(
        SHAPE,
        KvFormat::Int8,
        n * SHAPE.tokens,
        Box::<HeapChunks>::default(),
        tokens,
        vec![KvFormat::Int8; n],
    )
    .unwrap();
    for (i, b) in chunks.iter().enumerate() {
        c.restore(i, KvFormat::Int8, b).unwrap();
    }
    c
}

fn bench(c: &mut Criterion) {
    let one = chunk(1);
    let mut out = Vec::new();
    let mut g = c.benchmark_group("recompress/chunk");
    g.throughput(Throughput::Bytes(one.len() as u64));
    for to in [KvFormat::K8v8, KvFormat::K4v4, KvFormat::K4v3] {
        g.bench_function(format!("int8-to-{to}"), |b| {
            b.iter(|| codec::recompress(&SHAPE, KvFormat::Int8, to, black_box(&one), &mut out))
        });
    }
    g.finish();

    let chunks: Vec<Vec<u8>> = (0..128).map(chunk).collect();
    let moves: Vec<(usize, KvFormat)> = (0..128).map(|i| (i, KvFormat::K4v3)).collect();
    let mut g = c.benchmark_group("recompress/128-chunks");
    g.sample_size(10);
    g.bench_function("one-by-one", |b| {
        b.iter_batched(
            || cache(&chunks),
            |mut c| {
                for &(i, f) in &moves {
                    c.recompress(i, f).unwrap();
                }
                c
            },
            BatchSize::LargeInput,
        )
    });
    g.bench_function("recompress_many", |b| {
        b.iter_batched(
            || cache(&chunks),
            |mut c| {
                c.recompress_many(&moves).unwrap();
                c
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
