//! Decode attention's kernels over stored KV, per stored kind and instruction path: the scores
//! of a KV head's three query rows against one chunk's 16 keys (`dot_rows_codes`) and their
//! weighted sum of its 16 value rows (`axpy_rows_codes`), head size 64 (the default model's),
//! the chunk in L1: what the kernels cost when memory is not the limit, reported as stored
//! values per second.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use model::kernels::{Codes, axpy_rows_codes_with, dot_rows_codes_with};
use model::qmatrix::Isa;

fn bench(c: &mut Criterion) {
    let (hd, n, rows) = (64, 16, 3);
    let kinds = [
        Codes::Unsigned(2),
        Codes::Unsigned(3),
        Codes::Unsigned(4),
        Codes::Unsigned(8),
        Codes::Signed8,
        Codes::F16,
    ];
    let q: Vec<f32> = (0..rows * hd)
        .map(|i| ((i * 31 % 17) as f32 - 8.0) / 8.0)
        .collect();
    let w: Vec<f32> = (0..rows * n).map(|i| (i % 5) as f32 / 5.0).collect();
    let bias = vec![0.5f32; rows];
    let mut g = c.benchmark_group("kvcodes");
    g.throughput(Throughput::Elements((n * hd) as u64));
    for kind in kinds {
        // f16 codes are two bytes each; the sub-byte ones are packed.
        let len = (n * hd * kind.bits()).div_ceil(8);
        let codes: Vec<u8> = (0..len).map(|i| (i * 7919 % 251) as u8 & 0x3b).collect();
        for isa in Isa::all_available() {
            let mut out = vec![0.0f32; rows * n];
            g.bench_function(format!("dot/{kind:?}/{isa:?}"), |b| {
                b.iter(|| {
                    dot_rows_codes_with(
                        isa,
                        black_box(&q),
                        &bias,
                        black_box(&codes),
                        0,
                        kind,
                        hd,
                        &mut out,
                        n,
                        n,
                    )
                })
            });
            let mut o = vec![0.0f32; rows * hd];
            g.bench_function(format!("axpy/{kind:?}/{isa:?}"), |b| {
                b.iter(|| {
                    axpy_rows_codes_with(
                        isa,
                        &mut o,
                        &bias,
                        black_box(&w),
                        n,
                        n,
                        black_box(&codes),
                        0,
                        kind,
                        hd,
                    )
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
