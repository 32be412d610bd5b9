//! Exact recompute of interleaved chunks on the real model: rebuilt chunks equal the originals
//! whatever the prefill's piece size, and the next token's logits equal an uninterrupted run's.

use model::fetch::{self, FetchOptions};
use model::int8gemm::{Path, PrefillActs};
use model::kv::recompute::{RecomputeError, recompute_chunks};
use model::kv::{HeapChunks, KvCache, KvFormat, decode_k, decode_v};
use model::tokenizer::Tokenizer;
use model::{Logits, Model};
use std::sync::OnceLock;

const TEXT: &str = "The lighthouse keeper climbed the spiral stairs every evening at dusk, \
counting the steps as his father had taught him. One hundred and twelve steps, each worn smooth \
in the middle by a century of boots. At the top he trimmed the wick, polished the great lens, \
and wrote the weather in a ledger whose first pages were older than the town itself. Ships no \
longer needed the light, for they carried their own maps of the sea inside small glowing \
screens, but the harbour council had voted, year after year, to keep the lamp burning. Nobody \
could say exactly why. Some said it was tradition; others said that a town without a light was \
a town that had forgotten the sea. The keeper himself never gave an opinion. He simply climbed, \
counted, trimmed, polished and wrote, and when the storms came in November he stayed up all \
night watching the beam sweep across the black water, as if somebody out there might still be \
looking for it.";

/// Sealed chunks of the test context, and the extra tokens left in the open chunk.
const CHUNKS: usize = 10;
const TAIL: usize = 5;

struct Fixture {
    model: Model,
    /// The same weights with int8 prefill activations, where the CPU multiplies int8 fast
    /// (AVX-512 VNNI; the portable int8 path would take minutes here).
    int8: Option<Model>,
    tokens: Vec<u32>,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let path = fetch::default_model_path(&FetchOptions::default())
            .unwrap_or_else(|e| panic!("cannot fetch the default model: {e}"));
        let model = Model::load(&path).unwrap_or_else(|e| panic!("cannot load the model: {e}"));
        let int8 = Path::Vnni.available().then(|| {
            let mut m = Model::load(&path).unwrap();
            m.set_prefill_activations(PrefillActs::Int8);
            m
        });
        let tok = Tokenizer::from_gguf_file(&path).unwrap();
        let mut tokens = tok.encode(TEXT);
        while tokens.len() < CHUNKS * 16 + TAIL + 1 {
            tokens.extend(tok.encode(TEXT));
        }
        tokens.truncate(CHUNKS * 16 + TAIL + 1);
        Fixture {
            model,
            int8,
            tokens,
        }
    })
}

/// The context (all but the last token) prefilled in pieces of `piece` tokens.
fn prefill(model: &Model, format: KvFormat, piece: usize) -> KvCache {
    let f = fixture();
    let mut c = KvCache::new(
        model.chunk_shape(16),
        format,
        1024,
        Box::new(HeapChunks::default()),
    );
    let ctx = &f.tokens[..f.tokens.len() - 1];
    for p in ctx.chunks(piece) {
        model.forward(&mut c, p, Logits::Last).unwrap();
    }
    assert_eq!(c.chunk_formats().len(), CHUNKS);
    c
}

/// The logits of the context's last token, run after the cache.
fn next_logits(model: &Model, c: &mut KvCache) -> Vec<f32> {
    let f = fixture();
    let last = *f.tokens.last().unwrap();
    model.forward(c, &[last], Logits::Last).unwrap()
}

fn snapshot(c: &KvCache) -> Vec<Vec<u8>> {
    (0..CHUNKS)
        .map(|i| c.chunk_bytes(i).unwrap().to_vec())
        .collect()
}

/// Every K and V value of chunk `i`, decoded to f32, per layer.
fn decoded(c: &KvCache, i: usize) -> Vec<Vec<f32>> {
    let s = *c.shape();
    let f = c.chunk_formats()[i];
    let bytes = c.chunk_bytes(i).unwrap();
    let lb = s.layer_bytes(f);
    (0..s.n_layers)
        .map(|l| {
            let mut out = vec![0.0; 2 * s.section()];
            let (k, v) = out.split_at_mut(s.section());
            for h in 0..s.n_kv_heads {
                let layer = &bytes[l * lb..(l + 1) * lb];
                decode_k(&s, f, layer, h, &mut k[h * s.block()..]);
                decode_v(&s, f, layer, h, &mut v[h * s.block()..]);
            }
            out
        })
        .collect()
}

fn subsets() -> Vec<(&'static str, Vec<usize>)> {
    vec![
        ("first", vec![0]),
        ("last", vec![CHUNKS - 1]),
        ("every other", (0..CHUNKS).step_by(2).collect()),
        ("all", (0..CHUNKS).collect()),
        ("random", vec![7, 1, 4, 5]),
    ]
}

fn reclaim_and_recompute(model: &Model, c: &mut KvCache, set: &[usize]) {
    for &i in set {
        c.reclaim(i).unwrap();
    }
    assert_eq!(c.missing_chunks().len(), set.len());
    let stats = recompute_chunks(model, c, set).unwrap();
    assert_eq!(stats.chunks, set.len());
    assert!(c.missing_chunks().is_empty());
}

#[test]
fn f16_chunks_recompute_bit_exactly_and_the_next_logits_are_unchanged() {
    let m = &fixture().model;
    let mut c = prefill(m, KvFormat::F16, 16);
    let original = snapshot(&c);
    let attention = c.attention_received().0.to_vec();
    for (name, set) in subsets() {
        reclaim_and_recompute(m, &mut c, &set);
        for (i, want) in original.iter().enumerate() {
            assert!(
                c.chunk_bytes(i).unwrap() == &want[..],
                "{name}: chunk {i} differs"
            );
        }
    }
    // Recompute records no attention: densities stay those of the original pass.
    assert_eq!(c.attention_received().0, &attention[..]);
    let got = next_logits(m, &mut c);
    let want = next_logits(m, &mut prefill(m, KvFormat::F16, 16));
    assert_eq!(got, want);
}

#[test]
fn prefill_pieces_change_no_byte_and_batched_recompute_after_any_of_them_is_exact() {
    // Block-causal prefill: a chunk's bytes do not depend on the prefill's piece size. The
    // model's hidden (576) and FFN (1536) sizes span several GEMM depth blocks, whose split the
    // gemm crate picks from the product's shape: slicing the depth at 512 keeps every row's
    // rounding alike. int8 prefill is batch-independent by construction (its shadow outliers
    // too: each row's own); checked here where the CPU runs it fast (the portable int8 path
    // agrees with the VNNI one bit for bit, and the kernel tests check that on any CPU).
    let f = fixture();
    for m in std::iter::once(&f.model).chain(&f.int8) {
        pieces_and_recompute_are_exact(m);
    }
}

fn pieces_and_recompute_are_exact(m: &Model) {
    let whole = prefill(m, KvFormat::Int8, 256);
    let original = snapshot(&whole);
    for piece in [16, 64, 100] {
        let c = prefill(m, KvFormat::Int8, piece);
        for (i, want) in original.iter().enumerate() {
            assert!(
                c.chunk_bytes(i).unwrap() == &want[..],
                "piece {piece}: chunk {i} differs"
            );
        }
    }
    let mut c = whole;
    for (name, set) in subsets() {
        reclaim_and_recompute(m, &mut c, &set);
        for (i, want) in original.iter().enumerate() {
            assert!(
                c.chunk_bytes(i).unwrap() == &want[..],
                "{name}: chunk {i} differs"
            );
        }
    }
    let got = next_logits(m, &mut c);
    let want = next_logits(m, &mut prefill(m, KvFormat::Int8, 256));
    assert_eq!(got, want);
}

/// Largest difference between two chunks' values, relative to the largest value of the chunk.
fn relative_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(a, b)| {
            let amax = a.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            let d = a
                .iter()
                .zip(b)
                .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
            d / amax
        })
        .fold(0.0, f32::max)
}

#[test]
fn quantized_and_mixed_chunks_recompute_within_quantization_error() {
    let m = &fixture().model;
    // Chunks recompressed after the prefill: the original pass saw them in int8, recompute sees
    // them in int4 or int2, so the chunks after them differ by quantization noise.
    let mut c = prefill(m, KvFormat::Int8, 64);
    for i in [2, 3, 8] {
        c.recompress(i, KvFormat::Int4).unwrap();
    }
    c.recompress(6, KvFormat::Int2).unwrap();
    let formats = c.chunk_formats().to_vec();
    let original: Vec<_> = (0..CHUNKS).map(|i| decoded(&c, i)).collect();
    let mut uninterrupted = prefill(m, KvFormat::Int8, 64);
    for i in [2, 3, 8] {
        uninterrupted.recompress(i, KvFormat::Int4).unwrap();
    }
    uninterrupted.recompress(6, KvFormat::Int2).unwrap();
    let want = next_logits(m, &mut uninterrupted);

    let set = [0, 1, 3, 6, 9];
    reclaim_and_recompute(m, &mut c, &set);
    assert_eq!(c.chunk_formats(), &formats[..]);
    for i in 0..CHUNKS {
        let d = relative_diff(&original[i], &decoded(&c, i));
        if set.contains(&i) {
            // Rebuilt chunks attend to the int4/int2 chunks before them where the original saw
            // int8, and int4/int2 chunks are quantized afresh rather than from int8.
            let bound = match formats[i] {
                KvFormat::Int2 => 0.5,
                KvFormat::Int4 => 0.2,
                _ => 0.1,
            };
            assert!(d <= bound, "chunk {i} ({}): relative diff {d}", formats[i]);
        } else {
            assert_eq!(d, 0.0, "resident chunk {i} was touched");
        }
    }
    let got = next_logits(m, &mut c);
    let max = got
        .iter()
        .zip(&want)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    // Measured 0.75 (logits span about 30); the prediction is the same.
    assert!(max < 1.5, "next logits differ by up to {max}");
    let argmax = |l: &[f32]| model::generate::argmax(l);
    assert_eq!(argmax(&got), argmax(&want));
}

#[test]
fn recompute_refuses_what_it_cannot_do() {
    let model = &fixture().model;
    let mut c = prefill(model, KvFormat::Int8, 64);
    let err = recompute_chunks(model, &mut c, &[CHUNKS]).unwrap_err();
    assert!(matches!(
        err,
        RecomputeError::NotSealed {
            index: CHUNKS,
            sealed: CHUNKS
        }
    ));
    c.reclaim(2).unwrap();
    c.reclaim(5).unwrap();
    let err = recompute_chunks(model, &mut c, &[5]).unwrap_err();
    assert!(matches!(
        err,
        RecomputeError::Dependency {
            chunk: 5,
            missing: 2
        }
    ));
    // Nothing changed: both are still missing, and recomputing both works.
    assert_eq!(c.missing_chunks(), vec![2, 5]);
    recompute_chunks(model, &mut c, &[5, 2, 5]).unwrap();
    assert!(c.missing_chunks().is_empty());
}
