//! Every architecture family against a plain reference forward pass written from the families'
//! definitions (Hugging Face's modeling code for llama, qwen2 and gemma3, and Llama 3's RoPE
//! frequency factors): f64, every weight dequantized, the whole attention matrix, nothing shared
//! with the engine but the GGUF reader. Tiny random-weight files the test writes carry each
//! family's extra tensors (qwen2's QKV biases, gemma3's q/k and post norms, a sliding window on
//! some layers, Llama 3's `rope_freqs`).
#![allow(clippy::print_stderr)]

use candle_core::Device;
use candle_core::quantized::gguf_file::{Content, Value};
use model::config::Family;
use model::int8gemm::PrefillActs;
use model::kv::{HeapChunks, KvCache, KvFormat};
use model::tiny::{TinySpec, write_tiny_gguf};
use model::{Logits, Model};
use std::collections::HashMap;
use std::path::Path;

/// The reference's weights and shape, read from the file by the reference's own rules.
struct Reference {
    arch: String,
    t: HashMap<String, Vec<f64>>,
    n_layers: usize,
    hidden: usize,
    n_heads: usize,
    n_kv: usize,
    hd: usize,
    vocab: usize,
    eps: f64,
    base: f64,
    window: Option<(usize, usize)>,
}

impl Reference {
    fn load(path: &Path) -> Self {
        let mut f = std::fs::File::open(path).unwrap();
        let ct = Content::read(&mut f).unwrap();
        let arch = match &ct.metadata["general.architecture"] {
            Value::String(s) => s.clone(),
            v => panic!("{v:?}"),
        };
        let u = |k: &str| {
            ct.metadata
                .get(&format!("{arch}.{k}"))
                .map(|v| v.to_u32().unwrap() as usize)
        };
        let mut t: HashMap<String, Vec<f64>> = HashMap::new();
        for name in ct.tensor_infos.keys() {
            let q = ct.tensor(&mut f, name, &Device::Cpu).unwrap();
            let v: Vec<f32> = q
                .dequantize(&Device::Cpu)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            t.insert(name.clone(), v.into_iter().map(f64::from).collect());
        }
        let (hidden, n_heads) = (
            u("embedding_length").unwrap(),
            u("attention.head_count").unwrap(),
        );
        let base = match ct.metadata.get(&format!("{arch}.rope.freq_base")) {
            Some(Value::F32(b)) => f64::from(*b),
            _ => 10_000.0,
        };
        Self {
            n_layers: u("block_count").unwrap(),
            hidden,
            n_heads,
            n_kv: u("attention.head_count_kv").unwrap(),
            hd: u("attention.key_length").unwrap_or(hidden / n_heads),
            vocab: t["token_embd.weight"].len() / hidden,
            eps: 1e-5,
            base,
            window: u("attention.sliding_window")
                .map(|w| (w, u("attention.sliding_window_pattern").unwrap())),
            arch,
            t,
        }
    }

    fn w(&self, name: &str) -> &[f64] {
        &self.t[name]
    }

    /// `W x` for `W` = tensor `name` of `rows` rows.
    fn mv(&self, name: &str, x: &[f64]) -> Vec<f64> {
        self.w(name)
            .chunks_exact(x.len())
            .map(|r| r.iter().zip(x).map(|(a, b)| a * b).sum())
            .collect()
    }

    fn norm(&self, x: &[f64], name: &str) -> Vec<f64> {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let r = 1.0 / (ms + self.eps).sqrt();
        x.iter().zip(self.w(name)).map(|(v, w)| v * r * w).collect()
    }

    /// Rotates one head at `pos`: pairs (2i, 2i+1) for llama, (i, i + d/2) for qwen2 and gemma.
    fn rope(&self, head: &mut [f64], pos: usize, base: f64, factors: Option<&[f64]>) {
        let d = head.len();
        for i in 0..d / 2 {
            let theta = base.powf(-((2 * i) as f64) / d as f64) / factors.map_or(1.0, |f| f[i]);
            let (s, c) = (pos as f64 * theta).sin_cos();
            let (a, b) = if self.arch == "llama" {
                (2 * i, 2 * i + 1)
            } else {
                (i, i + d / 2)
            };
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0 * c - x1 * s;
            head[b] = x0 * s + x1 * c;
        }
    }

    /// The logits of every position of `tokens`, `[n][vocab]`; `window` off when `!windows`
    /// (the negative control: the same model with every layer global).
    fn logits(&self, tokens: &[u32], windows: bool) -> Vec<Vec<f64>> {
        let gemma = self.arch == "gemma3";
        let h = self.hidden;
        let mut x: Vec<Vec<f64>> = tokens
            .iter()
            .map(|&t| {
                let row = &self.w("token_embd.weight")[t as usize * h..(t as usize + 1) * h];
                let s = if gemma { (h as f64).sqrt() } else { 1.0 };
                row.iter().map(|v| v * s).collect()
            })
            .collect();
        for l in 0..self.n_layers {
            self.layer(l, &mut x, windows);
        }
        let head = if self.t.contains_key("output.weight") {
            "output.weight"
        } else {
            "token_embd.weight"
        };
        x.iter()
            .map(|xr| {
                let xn = self.norm(xr, "output_norm.weight");
                let l = self.mv(head, &xn);
                assert_eq!(l.len(), self.vocab);
                l
            })
            .collect()
    }

    /// Layer `l` over every position's hidden state `x`.
    fn layer(&self, l: usize, x: &mut [Vec<f64>], windows: bool) {
        let gemma = self.arch == "gemma3";
        let (hd, nh, nkv) = (self.hd, self.n_heads, self.n_kv);
        let factors = self.t.get("rope_freqs.weight").map(Vec::as_slice);
        {
            let p = |s: &str| format!("blk.{l}.{s}.weight");
            let local = self
                .window
                .filter(|&(_, pat)| windows && l % pat < pat - 1)
                .map(|(w, _)| w);
            let (base, ff) = match local {
                Some(_) => (10_000.0, None),
                None => (self.base, factors),
            };
            let mut qs = Vec::new();
            let mut ks = Vec::new();
            let mut vs = Vec::new();
            for (pos, xr) in x.iter().enumerate() {
                let xn = self.norm(xr, &p("attn_norm"));
                let mut q = self.mv(&p("attn_q"), &xn);
                let mut k = self.mv(&p("attn_k"), &xn);
                let mut v = self.mv(&p("attn_v"), &xn);
                if self.arch == "qwen2" {
                    let b = |s: &str| format!("blk.{l}.{s}.bias");
                    for (y, name) in [(&mut q, "attn_q"), (&mut k, "attn_k"), (&mut v, "attn_v")] {
                        y.iter_mut()
                            .zip(self.w(&b(name)))
                            .for_each(|(a, b)| *a += b);
                    }
                }
                for (y, n) in [(&mut q, "attn_q_norm"), (&mut k, "attn_k_norm")] {
                    for head in y.chunks_exact_mut(hd) {
                        if gemma {
                            let normed = self.norm(head, &p(n));
                            head.copy_from_slice(&normed);
                        }
                        self.rope(head, pos, base, ff);
                    }
                }
                qs.push(q);
                ks.push(k);
                vs.push(v);
            }
            for (i, xr) in x.iter_mut().enumerate() {
                let first = local.map_or(0, |w| (i + 1).saturating_sub(w));
                let mut att = vec![0.0; nh * hd];
                for head in 0..nh {
                    let g = head / (nh / nkv);
                    let q = &qs[i][head * hd..(head + 1) * hd];
                    let s: Vec<f64> = (first..=i)
                        .map(|j| {
                            let k = &ks[j][g * hd..(g + 1) * hd];
                            q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                        })
                        .collect();
                    let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = s.iter().map(|v| (v - m).exp()).sum();
                    for (j, sv) in (first..=i).zip(&s) {
                        let a = (sv - m).exp() / z;
                        for d in 0..hd {
                            att[head * hd + d] += a * vs[j][g * hd + d];
                        }
                    }
                }
                let mut o = self.mv(&p("attn_output"), &att);
                if gemma {
                    o = self.norm(&o, &p("post_attention_norm"));
                }
                xr.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
                let xn = self.norm(xr, &p("ffn_norm"));
                let g = self.mv(&p("ffn_gate"), &xn);
                let u = self.mv(&p("ffn_up"), &xn);
                let a: Vec<f64> = g
                    .iter()
                    .zip(&u)
                    .map(|(&g, &u)| {
                        let act = if gemma {
                            let c = (2.0 / std::f64::consts::PI).sqrt();
                            0.5 * g * (1.0 + (c * (g + 0.044715 * g * g * g)).tanh())
                        } else {
                            g / (1.0 + (-g).exp())
                        };
                        act * u
                    })
                    .collect();
                let mut d = self.mv(&p("ffn_down"), &a);
                if gemma {
                    d = self.norm(&d, &p("post_ffw_norm"));
                }
                xr.iter_mut().zip(&d).for_each(|(a, b)| *a += b);
            }
        }
    }
}

/// The engine's logits of every prompt position (one batched prefill) and of three decode
/// steps after it (greedy), f16 KV and f32 products: `[n + 3][vocab]`, with the tokens fed.
fn engine_logits(path: &Path, prompt: &[u32]) -> (Vec<Vec<f32>>, Vec<u32>) {
    let mut m = Model::load(path).unwrap();
    m.set_prefill_activations(PrefillActs::F32);
    m.prefill_chunk = 24;
    let vocab = m.cfg.vocab;
    let mut cache = KvCache::new(
        m.chunk_shape(16),
        KvFormat::F16,
        m.cfg.max_ctx,
        Box::new(HeapChunks::default()),
    );
    let mut rows: Vec<Vec<f32>> = m
        .forward(&mut cache, prompt, Logits::All)
        .unwrap()
        .chunks_exact(vocab)
        .map(<[f32]>::to_vec)
        .collect();
    let mut tokens = prompt.to_vec();
    for _ in 0..3 {
        let last = rows.last().unwrap();
        let next = model::generate::argmax(last) as u32;
        tokens.push(next);
        rows.push(m.forward(&mut cache, &[next], Logits::Last).unwrap());
    }
    (rows, tokens)
}

/// Largest |engine − reference| over every logit, relative to the reference's largest |logit|.
fn gap(engine: &[Vec<f32>], reference: &[Vec<f64>]) -> f64 {
    let scale = reference
        .iter()
        .flatten()
        .fold(0.0f64, |m, v| m.max(v.abs()));
    let worst = engine
        .iter()
        .zip(reference)
        .flat_map(|(e, r)| e.iter().zip(r).map(|(a, b)| (f64::from(*a) - b).abs()))
        .fold(0.0, f64::max);
    worst / scale
}

/// One family's file against the reference: prefill and decode logits within f16-KV error;
/// returns the gap of the same model with its windows ignored (the negative control).
fn check(name: &str, spec: &TinySpec) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(format!("{name}.gguf"));
    write_tiny_gguf(&path, spec).unwrap();
    let prompt: Vec<u32> = (0..45u32).map(|t| (t * 37 + 11) % 260).collect();
    let (engine, tokens) = engine_logits(&path, &prompt);
    let r = Reference::load(&path);
    let want = r.logits(&tokens[..tokens.len() - 1], true);
    let g = gap(&engine, &want);
    eprintln!("{name}: gap {g:.2e}");
    assert!(g < 1e-3, "{name}: engine vs reference gap {g:.2e}");
    gap(&engine, &r.logits(&tokens[..tokens.len() - 1], false))
}

#[test]
fn llama_matches_the_reference() {
    check("llama", &TinySpec::default());
}

#[test]
fn qwen2_biases_and_halves_rope_match_the_reference() {
    let spec = TinySpec {
        family: Family::QWEN2,
        rope_base: 1_000_000.0,
        ..TinySpec::default()
    };
    check("qwen2", &spec);
}

/// Llama 3's `rope_freqs`: factors that slow the low frequencies down (as its scaling does) move
/// the logits, and the engine follows the reference.
#[test]
fn llama3_rope_frequency_factors_match_the_reference() {
    let spec = TinySpec {
        rope_freqs: Some(vec![1.0, 1.0, 1.5, 2.0, 4.0, 8.0, 8.0, 8.0]),
        ..TinySpec::default()
    };
    check("llama3", &spec);
    // Without the factors the same weights give other logits.
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.gguf"), dir.path().join("b.gguf"));
    write_tiny_gguf(&a, &spec).unwrap();
    write_tiny_gguf(&b, &TinySpec::default()).unwrap();
    let prompt: Vec<u32> = (0..45u32).map(|t| (t * 37 + 11) % 260).collect();
    let (la, _) = engine_logits(&a, &prompt);
    let (lb, _) = engine_logits(&b, &prompt);
    let d = la
        .iter()
        .flatten()
        .zip(lb.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(d > 1e-2, "rope_freqs changed nothing ({d})");
}

/// Gemma 3's shape: wider heads than hidden / heads, q/k norms, post norms, GeGLU, scaled
/// embeddings, and a window of 8 on two layers of every three, over a 48-token sequence: the
/// local layers see only their window (ignoring it is far off the engine's logits).
#[test]
fn gemma3_norms_geglu_and_sliding_windows_match_the_reference() {
    let spec = TinySpec {
        family: Family::GEMMA3,
        n_layers: 3,
        head_dim: Some(32),
        n_kv_heads: 1,
        window: Some((8, 3)),
        rope_base: 1_000_000.0,
        ..TinySpec::default()
    };
    let unwindowed = check("gemma3", &spec);
    assert!(
        unwindowed > 5e-2,
        "the windows changed nothing: gap without them {unwindowed:.2e}"
    );
}

/// The config is data: each family's fields, and an unknown architecture refused once.
#[test]
fn the_families_are_data_and_an_unknown_one_is_refused() {
    assert_eq!(Family::of("gemma3"), Some(Family::GEMMA3));
    assert_eq!(Family::of("qwen2"), Some(Family::QWEN2));
    assert_eq!(Family::of("mamba"), None);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("g.gguf");
    let spec = TinySpec {
        family: Family::GEMMA3,
        head_dim: Some(32),
        window: Some((8, 2)),
        ..TinySpec::default()
    };
    write_tiny_gguf(&path, &spec).unwrap();
    let cfg = model::config::ModelConfig::from_gguf_file(&path).unwrap();
    assert_eq!(cfg.head_dim, 32);
    assert_eq!(
        (0..2).map(|l| cfg.layer_window(l)).collect::<Vec<_>>(),
        [Some(8), None]
    );
    // Chunks are the family's size, but never wider than a window; a prefill step is sixteen.
    assert_eq!((cfg.chunk_tokens(), cfg.prefill_step()), (8, 128));
    let wide = TinySpec {
        window: Some((512, 2)),
        ..spec
    };
    write_tiny_gguf(&path, &wide).unwrap();
    let cfg = model::config::ModelConfig::from_gguf_file(&path).unwrap();
    assert_eq!(cfg.chunk_tokens(), Family::GEMMA3.chunk_tokens);
    assert_eq!(Family::GEMMA3.chunk_tokens, 32);
    assert_eq!(cfg.prefill_step(), 512);
    let path = dir.path().join("l.gguf");
    write_tiny_gguf(&path, &TinySpec::default()).unwrap();
    let cfg = model::config::ModelConfig::from_gguf_file(&path).unwrap();
    assert_eq!((cfg.chunk_tokens(), cfg.prefill_step()), (16, 256));
    assert_eq!(Model::load(&path).unwrap().prefill_chunk, 256);
}
