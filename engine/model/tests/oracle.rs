//! The engine against candle-transformers' quantized llama on the same GGUF (the real model).
//!
//! Two oracles: the GGUF as shipped (Q4_1 weights, which candle multiplies with activations
//! quantized to 8 bits), and the same weights dequantized to f32 (exact f32 products), which
//! isolates the engine's own error: f16 or int8 KV and summation order.

use candle_core::quantized::gguf_file::{self, Content};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use model::fetch::{FetchOptions, default_model_path};
use model::generate::argmax;
use model::int8gemm::PrefillActs;
use model::kv::{HeapChunks, KvCache, KvFormat};
use model::qmatrix::{Activations, Isa};
use model::tokenizer::{Message, Tokenizer};
use model::{Logits, Model};
use std::io::Cursor;
use std::path::Path;

fn oracle(path: &Path, f32_weights: bool) -> ModelWeights {
    let mut f = std::fs::File::open(path).unwrap();
    let ct = Content::read(&mut f).unwrap();
    if !f32_weights {
        return ModelWeights::from_gguf(ct, &mut f, &Device::Cpu).unwrap();
    }
    let mut tensors = Vec::new();
    for name in ct.tensor_infos.keys() {
        let q = ct.tensor(&mut f, name, &Device::Cpu).unwrap();
        let t = q.dequantize(&Device::Cpu).unwrap();
        tensors.push((name.clone(), QTensor::quantize(&t, GgmlDType::F32).unwrap()));
    }
    let md: Vec<(&str, &gguf_file::Value)> =
        ct.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut buf = Cursor::new(Vec::new());
    gguf_file::write(&mut buf, &md, &ts).unwrap();
    buf.set_position(0);
    let ct = Content::read(&mut buf).unwrap();
    ModelWeights::from_gguf(ct, &mut buf, &Device::Cpu).unwrap()
}

fn oracle_step(m: &mut ModelWeights, tokens: &[u32], pos: usize) -> Vec<f32> {
    let x = Tensor::new(tokens, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    m.forward(&x, pos)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

const PROMPTS: [&str; 5] = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three uses of copper.",
    "Why is the sky blue?",
];

fn model() -> (std::path::PathBuf, Model, Tokenizer) {
    let path = default_model_path(&FetchOptions::default()).unwrap();
    let mut m = Model::load(&path).unwrap();
    // The oracle checks hold the f32 reference path to f32 bounds; int8 prefill has its own.
    m.set_prefill_activations(PrefillActs::F32);
    let t = Tokenizer::from_gguf_file(&path).unwrap();
    (path, m, t)
}

fn cache(m: &Model, f: KvFormat) -> KvCache {
    KvCache::new(
        m.chunk_shape(16),
        f,
        m.cfg.max_ctx,
        Box::new(HeapChunks::default()),
    )
}

#[test]
fn prefill_logits_agree_with_both_oracles() {
    let (path, model, tok) = model();
    let text = std::fs::read_to_string("/usr/share/common-licenses/GPL-3").unwrap();
    // 300 tokens: several prefill steps and a partial last chunk.
    let tokens: Vec<u32> = tok.encode(&text)[..300].to_vec();
    let exact = oracle_step(&mut oracle(&path, true), &tokens, 0);
    let shipped = oracle_step(&mut oracle(&path, false), &tokens, 0);
    // (format, bound against f32 weights, bound against the shipped Q4_1 path)
    for (f, exact_bound, shipped_bound) in [(KvFormat::F16, 0.02, 1.0), (KvFormat::Int8, 0.25, 1.0)]
    {
        let mut c = cache(&model, f);
        let got = model.forward(&mut c, &tokens, Logits::Last).unwrap();
        let d_exact = max_abs_diff(&got, &exact);
        let d_shipped = max_abs_diff(&got, &shipped);
        assert!(
            d_exact <= exact_bound,
            "{f}: max |dlogit| vs f32 oracle {d_exact}"
        );
        assert!(
            d_shipped <= shipped_bound,
            "{f}: max |dlogit| vs Q4_1 oracle {d_shipped}"
        );
        assert_eq!(argmax(&got), argmax(&exact), "{f}");
    }
}

#[test]
fn greedy_continuations_match_the_oracle_for_32_tokens() {
    let (path, model, tok) = model();
    let mut reference = oracle(&path, true);
    for p in PROMPTS {
        let prompt = tok.encode_chat(&[Message::user(p)], true).unwrap();
        reference.clear_kv_cache();
        let mut want = Vec::new();
        let mut logits = oracle_step(&mut reference, &prompt, 0);
        for i in 0..32 {
            let t = argmax(&logits);
            want.push(t);
            logits = oracle_step(&mut reference, &[t], prompt.len() + i);
        }
        let mut c = cache(&model, KvFormat::F16);
        let mut got = Vec::new();
        let mut logits = model.forward(&mut c, &prompt, Logits::Last).unwrap();
        for _ in 0..32 {
            let t = argmax(&logits);
            got.push(t);
            logits = model.forward(&mut c, &[t], Logits::Last).unwrap();
        }
        assert_eq!(tok.decode(&got), tok.decode(&want), "prompt {p:?}");
    }
}

#[test]
fn chunked_prefill_and_token_by_token_agree() {
    let (_, mut model, tok) = model();
    let tokens = tok.encode("The quick brown fox jumps over the lazy dog, again and again, until the dog wakes up and the fox runs into the forest where nobody can find it.");
    let mut c = cache(&model, KvFormat::F16);
    let whole = model.forward(&mut c, &tokens, Logits::All).unwrap();
    model.prefill_chunk = 7;
    let mut c = cache(&model, KvFormat::F16);
    let pieces = model.forward(&mut c, &tokens, Logits::All).unwrap();
    assert!(max_abs_diff(&whole, &pieces) < 0.05);
    let mut c = cache(&model, KvFormat::F16);
    let last_only = model.forward(&mut c, &tokens, Logits::Last).unwrap();
    let vocab = model.cfg.vocab;
    assert!(max_abs_diff(&whole[whole.len() - vocab..], &last_only) < 0.05);
}

/// int8 prefill (per-block int8 activations, on the best path this CPU has, else portable): the
/// same top token as the f32 oracle on real text, logits about as close to it as candle's own
/// quantized path (which also quantizes activations to 8 bits), and on chat prompts the f32
/// path's first answer token unless the f32 path itself had a near-tie there, with logits no
/// farther from the f32 prefill's than candle's 8-bit activations move its own on that prompt.
/// (A fixed bound of 1.0 failed on AVX2, at 1.03 on the first prompt, where candle's is 1.35.)
#[test]
fn int8_prefill_stays_close_to_the_oracles() {
    let (path, mut model, tok) = model();
    model.set_prefill_activations(PrefillActs::Int8);
    assert_eq!(model.prefill_activations(), PrefillActs::Int8);
    let text = std::fs::read_to_string("/usr/share/common-licenses/GPL-3").unwrap();
    let tokens: Vec<u32> = tok.encode(&text)[..300].to_vec();
    let exact = oracle_step(&mut oracle(&path, true), &tokens, 0);
    let shipped = oracle_step(&mut oracle(&path, false), &tokens, 0);
    let mut c = cache(&model, KvFormat::F16);
    let got = model.forward(&mut c, &tokens, Logits::Last).unwrap();
    let d_exact = max_abs_diff(&got, &exact);
    let d_shipped = max_abs_diff(&shipped, &exact);
    assert!(
        d_exact <= d_shipped.max(0.5) * 1.5,
        "int8 prefill: max |dlogit| vs f32 oracle {d_exact}, candle's Q4_1 path {d_shipped}"
    );
    assert_eq!(argmax(&got), argmax(&exact));
    // A forward pass from position 0 starts the oracles' caches afresh.
    let (mut shipped_model, mut exact_model) = (oracle(&path, false), oracle(&path, true));
    for p in PROMPTS {
        let prompt = tok.encode_chat(&[Message::user(p)], true).unwrap();
        let mut last = |acts| {
            model.set_prefill_activations(acts);
            let mut c = cache(&model, KvFormat::F16);
            model.forward(&mut c, &prompt, Logits::Last).unwrap()
        };
        let (want, got) = (last(PrefillActs::F32), last(PrefillActs::Int8));
        let d = max_abs_diff(&want, &got);
        // candle's own quantized path against the exact one on this prompt: how far 8-bit
        // activations (its q8_1) move these logits (1.35 on the first prompt, 0.63-0.82 on
        // the others; this engine's int8 prefill moved them 0.35-1.04 on AVX-512 and AVX2).
        let candle = max_abs_diff(
            &oracle_step(&mut shipped_model, &prompt, 0),
            &oracle_step(&mut exact_model, &prompt, 0),
        );
        let (a, b) = (argmax(&want), argmax(&got));
        if a != b {
            let margin = want[a as usize] - want[b as usize];
            assert!(
                margin <= 2.0 * d,
                "prompt {p:?}: int8 prefill picks {b} where f32 leads by {margin} (max |dlogit| {d})"
            );
        }
        assert!(
            d <= candle.max(0.5),
            "prompt {p:?}: max |dlogit| int8 vs f32 prefill {d}, candle's 8-bit activations {candle}"
        );
    }
}

/// The default decode activations (`auto`: 16-bit for Q4_1 and Q8_0 where the CPU has AVX2)
/// keep the f32 products' greedy continuations, where int8 ones flip this model's near ties:
/// along each prompt's f32 continuation, every step's logits stay within 0.05 of f32's and at
/// most a tenth of int8's distance from them.
#[test]
fn auto_decode_activations_keep_the_f32_continuations() {
    let (_, mut model, tok) = model();
    let mut int16_seen = false;
    for p in PROMPTS {
        let prompt = tok.encode_chat(&[Message::user(p)], true).unwrap();
        let mut runs = Vec::new();
        for acts in [Activations::F32, Activations::Auto, Activations::Int8] {
            model.set_activations(acts);
            let mut c = cache(&model, KvFormat::F16);
            runs.push((model.forward(&mut c, &prompt, Logits::Last).unwrap(), c));
        }
        let (mut d_auto, mut d_int8) = (0.0f32, 0.0f32);
        for _ in 0..32 {
            let t = argmax(&runs[0].0);
            assert_eq!(
                argmax(&runs[1].0),
                t,
                "prompt {p:?}: auto chose another token"
            );
            d_auto = d_auto.max(max_abs_diff(&runs[1].0, &runs[0].0));
            d_int8 = d_int8.max(max_abs_diff(&runs[2].0, &runs[0].0));
            for (acts, run) in [Activations::F32, Activations::Auto, Activations::Int8]
                .into_iter()
                .zip(runs.iter_mut())
            {
                model.set_activations(acts);
                run.0 = model.forward(&mut run.1, &[t], Logits::Last).unwrap();
            }
        }
        assert!(
            d_auto <= 0.05,
            "prompt {p:?}: max |dlogit| auto vs f32 {d_auto}"
        );
        if d_auto > 0.0 {
            int16_seen = true;
            assert!(
                d_auto * 10.0 <= d_int8,
                "prompt {p:?}: auto {d_auto} against int8 {d_int8}"
            );
        }
    }
    assert_eq!(
        int16_seen,
        Isa::Avx2.available(),
        "auto took 16-bit activations"
    );
}
