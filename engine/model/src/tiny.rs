//! A tiny random-weight model written as a real GGUF file, for tests that need the engine's code
//! paths but not real weights: llama by default, or any [`Family`] (qwen2's biases, gemma3's
//! norms and sliding windows, Llama 3's `rope_freqs`). Its vocabulary is GPT-2 byte-level BPE:
//! the 256 byte tokens, a few merges, and the ChatML special tokens, so the tokenizer loads from
//! it too.

use crate::config::Family;
use crate::qmatrix::{Kind, quantize};
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::path::Path;

/// The shape of a tiny model.
#[derive(Clone, Debug)]
pub struct TinySpec {
    /// Transformer blocks.
    pub n_layers: usize,
    /// Model width.
    pub hidden: usize,
    /// Query heads.
    pub n_heads: usize,
    /// KV heads.
    pub n_kv_heads: usize,
    /// Feed-forward width.
    pub ffn: usize,
    /// Maximum context.
    pub max_ctx: usize,
    /// Whether the output head is a separate tensor (else tied to the embeddings).
    pub separate_output: bool,
    /// Storage type of the weight matrices (quantized by candle).
    pub dtype: GgmlDType,
    /// If not empty, the weight matrices' formats instead of `dtype`, taken in turn (the
    /// embedding first, then each layer's in file order), quantized by
    /// [`crate::qmatrix::quantize`]: the K-quants need `hidden` and `ffn` multiples of 256.
    pub formats: Vec<Kind>,
    /// Seed of the random weights.
    pub seed: u64,
    /// `tokenizer.chat_template` (none by default: chat-format prompts are then refused).
    pub chat_template: Option<String>,
    /// The architecture: its metadata prefix and the tensors it adds (biases, norms).
    pub family: Family,
    /// Width of a head when it is not `hidden / n_heads` (written as `attention.key_length`).
    pub head_dim: Option<usize>,
    /// A sliding window and its pattern (every `pattern`-th layer global).
    pub window: Option<(usize, usize)>,
    /// A `rope_freqs` tensor (Llama 3's per-pair frequency factors).
    pub rope_freqs: Option<Vec<f32>>,
    /// RoPE base (of the global layers).
    pub rope_base: f32,
}

impl Default for TinySpec {
    fn default() -> Self {
        Self {
            n_layers: 2,
            hidden: 64,
            n_heads: 4,
            n_kv_heads: 2,
            ffn: 128,
            max_ctx: 512,
            separate_output: false,
            dtype: GgmlDType::Q8_0,
            formats: Vec::new(),
            seed: 42,
            chat_template: None,
            family: Family::LLAMA,
            head_dim: None,
            window: None,
            rope_freqs: None,
            rope_base: 10_000.0,
        }
    }
}

impl TinySpec {
    /// The width of one head.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden / self.n_heads)
    }
}

/// A ChatML template, enough for the tokenizer to use the `<|im_start|>`/`<|im_end|>` turns.
pub const TINY_CHATML: &str = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// GPT-2's byte-to-character map: printable bytes stand for themselves, the rest are shifted
/// above U+0100 so that every byte has a visible character.
pub fn byte_to_char() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        map[b as usize] = if printable {
            char::from_u32(b).unwrap_or('?')
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap_or('?')
        };
    }
    map
}

/// The merges of the tiny vocabulary (pairs of byte-characters); `Ġ` is the space byte.
pub const TINY_MERGES: [&str; 6] = ["Ġ t", "h e", "i n", "Ġt he", "e r", "o n"];

/// Writes a tiny random llama model to `path`.
pub fn write_tiny_gguf(path: &Path, spec: &TinySpec) -> candle_core::Result<()> {
    let md = tiny_metadata(spec);
    let vocab = match md.iter().find(|(k, _)| *k == "tokenizer.ggml.tokens") {
        Some((_, Value::Array(a))) => a.len(),
        _ => unreachable!("the tiny metadata lists its tokens"),
    };
    let tensors = tiny_tensors(spec, vocab)?;
    let mut f = std::fs::File::create(path)?;
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (*k, v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut f, &md_refs, &t_refs)?;
    f.sync_all()?;
    Ok(())
}

/// The tiny model's metadata: its shape and its byte-level BPE vocabulary.
fn tiny_metadata(spec: &TinySpec) -> Vec<(&'static str, Value)> {
    let map = byte_to_char();
    let mut tokens: Vec<String> = vec![
        "<|endoftext|>".into(),
        "<|im_start|>".into(),
        "<|im_end|>".into(),
    ];
    let mut types = vec![3i32; 3];
    tokens.extend(map.iter().map(|c| c.to_string()));
    types.extend(std::iter::repeat_n(1i32, 256));
    for m in TINY_MERGES {
        tokens.push(m.replace(' ', ""));
        types.push(1);
    }
    let vocab = tokens.len();
    let hd = spec.head_dim();
    let arr = |v: Vec<Value>| Value::Array(v);
    let arch = spec.family.arch;
    // Keys under the architecture's prefix (leaked: the metadata wants &'static str keys, and a
    // test writes a handful of files).
    let key = |k: &str| -> &'static str { Box::leak(format!("{arch}.{k}").into_boxed_str()) };
    let mut md: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String(arch.into())),
        ("general.name", Value::String(format!("tiny-random-{arch}"))),
        (key("block_count"), Value::U32(spec.n_layers as u32)),
        (key("context_length"), Value::U32(spec.max_ctx as u32)),
        (key("embedding_length"), Value::U32(spec.hidden as u32)),
        (key("feed_forward_length"), Value::U32(spec.ffn as u32)),
        (key("attention.head_count"), Value::U32(spec.n_heads as u32)),
        (
            key("attention.head_count_kv"),
            Value::U32(spec.n_kv_heads as u32),
        ),
        (key("rope.freq_base"), Value::F32(spec.rope_base)),
        (key("rope.dimension_count"), Value::U32(hd as u32)),
        (key("attention.layer_norm_rms_epsilon"), Value::F32(1e-5)),
        (key("vocab_size"), Value::U32(vocab as u32)),
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String("smollm".into())),
        (
            "tokenizer.ggml.tokens",
            arr(tokens.into_iter().map(Value::String).collect()),
        ),
        (
            "tokenizer.ggml.token_type",
            arr(types.into_iter().map(Value::I32).collect()),
        ),
        (
            "tokenizer.ggml.merges",
            arr(TINY_MERGES
                .iter()
                .map(|m| Value::String((*m).into()))
                .collect()),
        ),
        ("tokenizer.ggml.bos_token_id", Value::U32(1)),
        ("tokenizer.ggml.eos_token_id", Value::U32(2)),
        ("tokenizer.ggml.unknown_token_id", Value::U32(0)),
        ("tokenizer.ggml.padding_token_id", Value::U32(2)),
        ("tokenizer.ggml.add_bos_token", Value::Bool(false)),
    ];
    if let Some(t) = &spec.chat_template {
        md.push(("tokenizer.chat_template", Value::String(t.clone())));
    }
    if spec.head_dim.is_some() {
        md.push((key("attention.key_length"), Value::U32(hd as u32)));
        md.push((key("attention.value_length"), Value::U32(hd as u32)));
    }
    if let Some((w, pattern)) = spec.window {
        md.push((key("attention.sliding_window"), Value::U32(w as u32)));
        md.push((
            key("attention.sliding_window_pattern"),
            Value::U32(pattern as u32),
        ));
    }
    md
}

/// The tiny model's tensors, random with a fixed seed, scaled so activations stay near 1.
fn tiny_tensors(spec: &TinySpec, vocab: usize) -> candle_core::Result<Vec<(String, QTensor)>> {
    let hd = spec.head_dim();
    let mut rng = StdRng::seed_from_u64(spec.seed);
    let dev = Device::Cpu;
    let mut taken = 0;
    let mut mat = |rows: usize, cols: usize, scale: f32, dtype: GgmlDType| {
        let v: Vec<f32> = (0..rows * cols)
            .map(|_| (rng.random::<f32>() * 2.0 - 1.0) * scale)
            .collect();
        if let Some(&kind) = spec.formats.get(taken % spec.formats.len().max(1)) {
            taken += 1;
            let raw = quantize::quantize(kind, &v);
            return candle_core::quantized::ggml_file::qtensor_from_ggml(
                kind.ggml(),
                &raw,
                vec![rows, cols],
                &dev,
            );
        }
        let t = Tensor::from_vec(v, (rows, cols), &dev)?;
        QTensor::quantize(&t, dtype)
    };
    let vector = |v: Vec<f32>| -> candle_core::Result<QTensor> {
        let d = v.len();
        QTensor::quantize(&Tensor::from_vec(v, d, &dev)?, GgmlDType::F32)
    };
    let norm = |d: usize| vector((0..d).map(|i| 1.0 + 0.01 * (i % 7) as f32).collect());
    // Biases: a fixed pattern, large enough to move the scores.
    let bias = |d: usize| vector((0..d).map(|i| ((i % 5) as f32 - 2.0) * 0.1).collect());
    let fam = spec.family;
    let (h, kvd) = (spec.hidden, spec.n_kv_heads * hd);
    let w = 1.0 / (h as f32).sqrt();
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    tensors.push(("token_embd.weight".into(), mat(vocab, h, 1.0, spec.dtype)?));
    for l in 0..spec.n_layers {
        let p = |s: &str| format!("blk.{l}.{s}.weight");
        tensors.push((p("attn_norm"), norm(h)?));
        tensors.push((p("attn_q"), mat(spec.n_heads * hd, h, 2.0 * w, spec.dtype)?));
        tensors.push((p("attn_k"), mat(kvd, h, 2.0 * w, spec.dtype)?));
        tensors.push((p("attn_v"), mat(kvd, h, w, spec.dtype)?));
        tensors.push((p("attn_output"), mat(h, spec.n_heads * hd, w, spec.dtype)?));
        if fam.qkv_bias {
            let b = |s: &str| format!("blk.{l}.{s}.bias");
            tensors.push((b("attn_q"), bias(spec.n_heads * hd)?));
            tensors.push((b("attn_k"), bias(kvd)?));
            tensors.push((b("attn_v"), bias(kvd)?));
        }
        if fam.qk_norm {
            tensors.push((p("attn_q_norm"), norm(hd)?));
            tensors.push((p("attn_k_norm"), norm(hd)?));
        }
        if fam.post_norms {
            tensors.push((p("post_attention_norm"), norm(h)?));
            tensors.push((p("post_ffw_norm"), norm(h)?));
        }
        tensors.push((p("ffn_norm"), norm(h)?));
        tensors.push((p("ffn_gate"), mat(spec.ffn, h, w, spec.dtype)?));
        tensors.push((p("ffn_up"), mat(spec.ffn, h, w, spec.dtype)?));
        tensors.push((
            p("ffn_down"),
            mat(h, spec.ffn, 1.0 / (spec.ffn as f32).sqrt(), spec.dtype)?,
        ));
    }
    tensors.push(("output_norm.weight".into(), norm(h)?));
    if let Some(f) = &spec.rope_freqs {
        tensors.push(("rope_freqs.weight".into(), vector(f.clone())?));
    }
    if spec.separate_output {
        tensors.push(("output.weight".into(), mat(vocab, h, w, spec.dtype)?));
    }
    Ok(tensors)
}
