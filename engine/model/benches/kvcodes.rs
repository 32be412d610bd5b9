//! Decode attention's kernels over stored KV, per stored kind and instruction path: the scores
//! of a KV head's three query rows against one chunk's 16 keys (`dot_rows_codes`) and their
//! weighted sum of its 16 value rows (`axpy_rows_codes`), head size 64 (the default model's),
//! the chunk in L1: what the kernels cost when memory is not the limit, reported as stored
//! values per second. For the unsigned codes, `dot+fold` and `axpy+fold` time a chunk's whole
//! work as decode runs it: the parameters folded into the rows (`fold_params`) and the f32
//! kernel, against the integer kernels (`kernels::coded`, where the CPU has them), which fold
//! inside.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use model::kernels::{Codes, axpy_rows_codes_with, coded, dot_rows_codes_with, fold_params};
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
        if let Codes::Unsigned(bits) = kind {
            folded(&mut g, bits, &codes, &q, &w);
        }
    }
    g.finish();
}

/// A chunk's scores and weighted values over `bits`-bit codes with their parameters' folding,
/// in f32 and in integers.
fn folded(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    bits: usize,
    codes: &[u8],
    q: &[f32],
    w: &[f32],
) {
    let (hd, n, rows) = (64, 16, 3);
    let mins: Vec<f32> = (0..hd).map(|i| -0.5 - (i % 7) as f32 / 10.0).collect();
    let scales: Vec<f32> = (0..hd).map(|i| 0.01 + (i % 11) as f32 / 100.0).collect();
    let (mut qs, mut bias) = (vec![0.0f32; rows * hd], vec![0.0f32; rows]);
    let mut out = vec![0.0f32; rows * n];
    let kind = Codes::Unsigned(bits);
    g.bench_function(format!("dot+fold/{kind:?}/f32"), |b| {
        b.iter(|| {
            for r in 0..rows {
                let x = &q[r * hd..(r + 1) * hd];
                bias[r] = fold_params(x, &mins, &scales, &mut qs[r * hd..(r + 1) * hd]);
            }
            let isa = Isa::best();
            dot_rows_codes_with(
                isa,
                &qs,
                &bias,
                black_box(codes),
                0,
                kind,
                hd,
                &mut out,
                n,
                n,
            )
        })
    });
    if matches!(bits, 4 | 8) && coded::int8_available() {
        g.bench_function(format!("dot+fold/{kind:?}/int8"), |b| {
            b.iter(|| {
                let c = black_box(codes);
                coded::dot_rows_coded(q, hd, &mins, &scales, c, 0, bits, &mut out, n, n)
            })
        });
    }
    let mut ws = vec![0.0f32; rows * n];
    let mut o = vec![0.0f32; rows * hd];
    g.bench_function(format!("axpy+fold/{kind:?}/f32"), |b| {
        b.iter(|| {
            for r in 0..rows {
                let x = &w[r * n..(r + 1) * n];
                bias[r] = fold_params(x, &mins[..n], &scales[..n], &mut ws[r * n..(r + 1) * n]);
            }
            let isa = Isa::best();
            axpy_rows_codes_with(isa, &mut o, &bias, &ws, n, n, black_box(codes), 0, kind, hd)
        })
    });
    if coded::int8_available() {
        g.bench_function(format!("axpy+fold/{kind:?}/int8"), |b| {
            b.iter(|| {
                let (m, s) = (&mins[..n], &scales[..n]);
                let g = coded::ValueGroups::whole(hd);
                coded::axpy_rows_coded(&mut o, hd, w, n, n, m, s, g, black_box(codes), 0, bits)
            })
        });
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
