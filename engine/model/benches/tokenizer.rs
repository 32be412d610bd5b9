//! Tokenizer speed on real text: building from the GGUF, encoding with a cold and a warm word cache, decoding;
//! the same for Gemma 3's SentencePiece vocabulary (no cache: SentencePiece has no words to cache).

use std::hint::black_box;
use std::path::Path;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use model::fetch::{self, FetchOptions, GEMMA3_270M};
use model::tokenizer::{StreamDecoder, Tokenizer};

fn bench(c: &mut Criterion) {
    let model = match fetch::default_model_path(&FetchOptions::default()) {
        Ok(p) => p,
        Err(e) => panic!("cannot fetch the default model: {e}"),
    };
    let tok = match Tokenizer::from_gguf_file(&model) {
        Ok(t) => t,
        Err(e) => panic!("cannot build the tokenizer: {e}"),
    };
    let text = match std::fs::read_to_string(Path::new("/usr/share/common-licenses/GPL-3")) {
        Ok(t) => t,
        Err(e) => panic!("cannot read GPL-3: {e}"),
    };
    let ids = tok.encode(&text);

    c.bench_function("tokenizer/from_gguf_file", |b| {
        b.iter(|| {
            Tokenizer::from_gguf_file(black_box(&model))
                .map(|t| t.vocab_size())
                .ok()
        })
    });

    let mut g = c.benchmark_group("tokenizer/gpl3");
    g.throughput(Throughput::Elements(ids.len() as u64));
    g.bench_function("encode_cold_cache", |b| {
        b.iter(|| {
            tok.clear_cache();
            tok.encode(black_box(&text)).len()
        })
    });
    g.bench_function("encode_warm_cache", |b| {
        b.iter(|| tok.encode(black_box(&text)).len())
    });
    g.bench_function("decode", |b| b.iter(|| tok.decode(black_box(&ids)).len()));
    g.bench_function("stream_decode", |b| {
        b.iter(|| {
            let mut dec = StreamDecoder::new(true);
            ids.iter()
                .map(|&id| dec.push(&tok, id).len())
                .sum::<usize>()
        })
    });
    g.finish();

    let gemma = match fetch::ensure(&FetchOptions::default(), &GEMMA3_270M) {
        Ok(p) => p,
        Err(e) => panic!("cannot fetch gemma3-270m: {e}"),
    };
    let spm = match Tokenizer::from_gguf_file(&gemma) {
        Ok(t) => t,
        Err(e) => panic!("cannot build Gemma's tokenizer: {e}"),
    };
    let spm_ids = spm.encode(&text);
    c.bench_function("tokenizer/gemma3/from_gguf_file", |b| {
        b.iter(|| {
            Tokenizer::from_gguf_file(black_box(&gemma))
                .map(|t| t.vocab_size())
                .ok()
        })
    });
    let mut g = c.benchmark_group("tokenizer/gemma3/gpl3");
    g.throughput(Throughput::Elements(spm_ids.len() as u64));
    g.bench_function("encode", |b| b.iter(|| spm.encode(black_box(&text)).len()));
    g.bench_function("decode", |b| {
        b.iter(|| spm.decode(black_box(&spm_ids)).len())
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
