//! Batched int8 products (prefill) per stored format and instruction path, on synthetic
//! matrices of Gemma 3 270M's shapes (1536 × 640, the stacked QKV; 4096 × 640, gate and up;
//! 640 × 2048, down) and 256 tokens (a prefill step): the activations quantized once, the
//! product timed (the weights' repacking into panels included), reported in multiply-adds per
//! second (weights × tokens).

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use model::int8gemm::{Path, QuantRows, product};
use model::qmatrix::{Kind, QMatrix};

fn bench(c: &mut Criterion) {
    let kinds = [
        Kind::Q4_0,
        Kind::Q4_1,
        Kind::Q5_0,
        Kind::Q5_1,
        Kind::Q8_0,
        Kind::Q4_K,
        Kind::Q5_K,
        Kind::Q6_K,
    ];
    let tokens = 256;
    for (rows, cols) in [(1536, 640), (4096, 640), (640, 2048)] {
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 2001) as f32 - 1000.0) / 1000.0)
            .collect();
        let x: Vec<f32> = (0..tokens * cols)
            .map(|i| ((i * 31 % 17) as f32 - 8.0) / 8.0 + if i % cols == 5 { 20.0 } else { 0.0 })
            .collect();
        let mut q = QuantRows::default();
        q.quantize(&x, tokens, cols);
        let mut out = vec![0.0; tokens * rows];
        let mut g = c.benchmark_group(format!("prefill/{rows}x{cols}"));
        g.throughput(Throughput::Elements((rows * cols * tokens) as u64));
        for kind in kinds
            .into_iter()
            .filter(|k| cols.is_multiple_of(k.block_values()))
        {
            let m = QMatrix::quantize(rows, cols, kind, &w);
            for path in Path::all_available()
                .into_iter()
                .filter(|&p| p != Path::Portable)
            {
                g.bench_function(format!("{kind:?}/{path:?}"), |b| {
                    b.iter(|| product(path, &m, black_box(&q), &mut out))
                });
            }
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
