//! Weights under a budget give the same logits, bit for bit, as with every weight resident: on a
//! tiny random model (every budget, strategy and source) and on the real model (a few budgets).

use model::fetch::{self, FetchOptions};
use model::generate::argmax;
use model::kv::{HeapChunks, KvCache, KvFormat};
use model::stream::Residency;
use model::tiny::{TinySpec, write_tiny_gguf};
use model::tokenizer::Tokenizer;
use model::{Logits, Model, ModelError, WeightOptions, WeightSource};
use std::path::Path;

/// Prefill logits of every token (in pieces, so passes with and without the head) and the
/// logits of `decode` greedy tokens after them.
fn run(model: &Model, prompt: &[u32], decode: usize) -> (Vec<f32>, Vec<u32>, Vec<Vec<f32>>) {
    let mut cache = KvCache::new(
        model.chunk_shape(16),
        KvFormat::F16,
        512,
        Box::new(HeapChunks::default()),
    );
    let mut all = Vec::new();
    for p in prompt.chunks(24) {
        all.extend(model.forward(&mut cache, p, Logits::All).unwrap());
    }
    let mut logits = all[all.len() - model.cfg.vocab..].to_vec();
    let (mut toks, mut steps) = (Vec::new(), Vec::new());
    for _ in 0..decode {
        let t = argmax(&logits);
        toks.push(t);
        logits = model.forward(&mut cache, &[t], Logits::Last).unwrap();
        steps.push(logits.clone());
    }
    (all, toks, steps)
}

fn load(
    path: &Path,
    budget: Option<u64>,
    residency: Residency,
    source: WeightSource,
) -> Result<Model, ModelError> {
    let mut m = Model::load_with(
        path,
        &WeightOptions {
            budget,
            residency,
            source,
            slots: 2,
            read_bps: Some(1e9),
        },
    )?;
    m.prefill_chunk = 16;
    Ok(m)
}

#[test]
fn tiny_model_same_logits_at_every_budget() {
    let dir = tempfile::tempdir().unwrap();
    for (i, spec) in [
        TinySpec {
            hidden: 256,
            n_heads: 4,
            n_layers: 6,
            ..TinySpec::default()
        },
        TinySpec {
            hidden: 256,
            n_heads: 4,
            n_layers: 3,
            separate_output: true,
            dtype: candle_core::quantized::GgmlDType::Q4_1,
            ..TinySpec::default()
        },
    ]
    .into_iter()
    .enumerate()
    {
        let path = dir.path().join(format!("tiny{i}.gguf"));
        write_tiny_gguf(&path, &spec).unwrap();
        let prompt: Vec<u32> = (0..40u32).map(|t| (t * 37 + 5) % 260).collect();
        let full = load(&path, None, Residency::Preserve, WeightSource::Direct).unwrap();
        let total = full.weight_bytes() as u64;
        let reference = run(&full, &prompt, 8);
        let minimum = match load(&path, Some(1), Residency::Preserve, WeightSource::Direct) {
            Err(ModelError::Budget {
                budget: 1, minimum, ..
            }) => minimum,
            other => panic!("a 1-byte budget must be refused, got {:?}", other.err()),
        };
        assert!(minimum < total, "minimum {minimum} of {total}");
        let mut budgets = vec![minimum, total / 4, total / 2, total * 3 / 4, total];
        budgets.retain(|&b| b >= minimum);
        for budget in budgets {
            for residency in [
                Residency::Stream,
                Residency::InOrder,
                Residency::Balanced,
                Residency::Preserve,
            ] {
                let m = load(&path, Some(budget), residency, WeightSource::Direct).unwrap();
                let h = m.holding();
                assert!(
                    m.weight_bytes() as u64 + h.buffer_bytes <= budget,
                    "{budget} {residency:?}: holds {} + {}",
                    m.weight_bytes(),
                    h.buffer_bytes
                );
                assert!(
                    run(&m, &prompt, 8) == reference,
                    "model {i}, budget {budget}, {residency:?}"
                );
                if budget < total {
                    let c = m.stream_counters().expect("a stream under a budget");
                    assert!(c.reads.load(std::sync::atomic::Ordering::Relaxed) > 0);
                }
            }
        }
        let m = load(
            &path,
            Some(total / 4),
            Residency::Preserve,
            WeightSource::Mmap,
        )
        .unwrap();
        assert!(run(&m, &prompt, 8) == reference, "model {i}, mmap");
    }
}

#[test]
fn real_model_same_tokens_under_a_quarter_budget() {
    let path = fetch::default_model_path(&FetchOptions::default())
        .unwrap_or_else(|e| panic!("cannot fetch the default model: {e}"));
    let tok = Tokenizer::from_gguf_file(&path).unwrap();
    let prompt = tok.encode(
        "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps",
    );
    let full = Model::load(&path).unwrap();
    let total = full.weight_bytes() as u64;
    let (_, reference, ref_steps) = run(&full, &prompt, 12);
    drop(full);
    for frac in [4u64, 10] {
        let m = Model::load_with(
            &path,
            &WeightOptions {
                budget: Some(total / frac),
                ..WeightOptions::default()
            },
        )
        .unwrap();
        let (_, toks, steps) = run(&m, &prompt, 12);
        assert_eq!(toks, reference, "budget 1/{frac}");
        assert!(steps == ref_steps, "budget 1/{frac}: logits differ");
    }
}
