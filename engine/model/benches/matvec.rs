//! Decode matrix-vector products per stored format and instruction path, on synthetic matrices
//! of Gemma 3 270M's FFN shape (2048 × 640, the gate/up products, and 640 × 2048, the down
//! product) and of a larger 4096 × 4096 one, beside a plain read of the same bytes
//! ([`QMatrix::sum_bytes`] on two threads, how `llms bench engine` measures the read bandwidth),
//! with f32 activations, int8 ones (`/int8`, `--activations int8`) and, where the CPU has the
//! kernel, 16-bit ones (`/int16`): each reported as bytes of weights per second.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use model::qmatrix::{Activations, Isa, Kind, QMatrix};

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
    let shapes = [(2048, 640), (640, 2048), (4096, 4096)];
    for (rows, cols) in shapes {
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 2001) as f32 - 1000.0) / 1000.0)
            .collect();
        let x: Vec<f32> = (0..cols)
            .map(|i| ((i * 31 % 17) as f32 - 8.0) / 8.0)
            .collect();
        let mut out = vec![0.0; rows];
        let mut g = c.benchmark_group(format!("matvec/{rows}x{cols}"));
        // A row is whole blocks: llama.cpp stores 640-wide rows in the 32-value formats.
        for kind in kinds
            .into_iter()
            .filter(|k| cols.is_multiple_of(k.block_values()))
        {
            let m = QMatrix::quantize(rows, cols, kind, &w);
            // The same bytes in two halves, read on two threads as the engine bench reads.
            let half = rows / 2 * cols;
            let a = QMatrix::quantize(rows / 2, cols, kind, &w[..half]);
            let z = QMatrix::quantize(rows / 2, cols, kind, &w[half..]);
            g.throughput(Throughput::Bytes(m.bytes() as u64));
            g.bench_function(format!("{kind:?}/read"), |b| {
                b.iter(|| black_box(rayon::join(|| a.sum_bytes(), || z.sum_bytes())))
            });
            for isa in Isa::all_available() {
                g.bench_function(format!("{kind:?}/{isa:?}"), |b| {
                    b.iter(|| m.matvec_with(isa, Activations::F32, black_box(&x), &mut out))
                });
                g.bench_function(format!("{kind:?}/{isa:?}/int8"), |b| {
                    b.iter(|| m.matvec_with(isa, Activations::Int8, black_box(&x), &mut out))
                });
                if isa != Isa::Portable && matches!(kind, Kind::Q4_1 | Kind::Q8_0) {
                    g.bench_function(format!("{kind:?}/{isa:?}/int16"), |b| {
                        b.iter(|| m.matvec_with(isa, Activations::Int16, black_box(&x), &mut out))
                    });
                }
            }
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
