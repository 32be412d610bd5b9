//! A llama-family model loaded from GGUF, with weights repacked for speed, and its forward pass.
//!
//! Weights are dequantized once at load time: batched products (prefill, recompute, scoring)
//! run as f32 GEMM, single-token decode runs on a Q8_0 copy through candle's quantized kernels.
//! The prompt is prefilled in fixed-size chunks, so one set of shapes serves every length.

use crate::kv::attention::{AttnShape, attend};
use crate::kv::{ChunkShape, KvCache, KvError};
use crate::model::config::{ConfigError, ModelConfig};
use crate::model::kernels::{Rope, add_assign, matmul_nt, rms_norm, swiglu};
use crate::model::qmatvec::{BLOCK, QMatrix};
use candle_core::Device;
use candle_core::quantized::{GgmlDType, gguf_file};
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What went wrong loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The file could not be opened or read.
    #[error("cannot read model file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The file is not a GGUF file candle can parse (bad magic, unsupported tensor type...).
    #[error("{path} is not a readable GGUF file: {reason}")]
    Gguf { path: PathBuf, reason: String },
    /// The file ends before the tensor data it declares.
    #[error(
        "{path} is truncated: tensor {tensor:?} ends at byte {end} but the file has {len} bytes"
    )]
    Truncated {
        path: PathBuf,
        tensor: String,
        end: u64,
        len: u64,
    },
    /// The metadata does not describe a supported model.
    #[error("{path}: {source}")]
    Config { path: PathBuf, source: ConfigError },
    /// A tensor the architecture needs is absent.
    #[error("{path} has no tensor {name:?}")]
    MissingTensor { path: PathBuf, name: String },
    /// A tensor has the wrong shape.
    #[error("tensor {name:?} has shape {found:?}, expected {expected:?}")]
    Shape {
        name: String,
        found: Vec<usize>,
        expected: Vec<usize>,
    },
    /// A tensor's type cannot be converted.
    #[error("tensor {name:?} of type {dtype:?} cannot be loaded: {reason}")]
    TensorType {
        name: String,
        dtype: GgmlDType,
        reason: String,
    },
    /// A token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    BadToken { id: u32, vocab: usize },
    /// The KV cache refused the tokens.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// A candle kernel failed.
    #[error("kernel failed: {0}")]
    Kernel(String),
}

fn kernel(e: candle_core::Error) -> ModelError {
    ModelError::Kernel(e.to_string())
}

/// A weight matrix `[rows][cols]` kept in the two forms the two phases want.
pub struct Linear {
    rows: usize,
    cols: usize,
    /// f32 for batched products (GEMM).
    f32: Vec<f32>,
    /// 32-value blocks for single-row products: the file's own Q4_1/Q8_0 blocks, or Q8_0
    /// made from f32; absent when `cols` is not a multiple of 32.
    q: Option<QMatrix>,
}

/// Rows below which a product goes to the quantized matrix-vector kernel rather than GEMM.
const GEMM_MIN_ROWS: usize = 2;

/// One weight tensor as read: f32, and its blocks when the file stores Q4_1 or Q8_0.
struct Weight {
    rows: usize,
    cols: usize,
    f32: Vec<f32>,
    raw: Option<QMatrix>,
}

impl Linear {
    /// Stacks weights with equal column counts, rows after rows.
    fn stack(parts: Vec<Weight>) -> Self {
        let cols = parts[0].cols;
        let rows = parts.iter().map(|p| p.rows).sum();
        let all_raw = parts.iter().all(|p| p.raw.is_some());
        let mut f32 = Vec::with_capacity(rows * cols);
        let mut raws = Vec::new();
        for p in parts {
            f32.extend_from_slice(&p.f32);
            raws.extend(p.raw);
        }
        let q = if !cols.is_multiple_of(BLOCK) {
            None
        } else if all_raw && raws.windows(2).all(|w| w[0].same_kind(&w[1])) {
            Some(QMatrix::stack(raws))
        } else {
            Some(QMatrix::quantize_q8_0(rows, cols, &f32))
        };
        Self { rows, cols, f32, q }
    }

    /// `out[n][rows] = x[n][cols] · selfᵀ`.
    pub fn forward(&self, x: &[f32], n: usize, out: &mut [f32]) {
        match &self.q {
            Some(q) if n < GEMM_MIN_ROWS => {
                for i in 0..n {
                    q.matvec(
                        &x[i * self.cols..(i + 1) * self.cols],
                        &mut out[i * self.rows..(i + 1) * self.rows],
                    );
                }
            }
            _ => matmul_nt(out, x, &self.f32, n, self.rows, self.cols),
        }
    }

    /// Bytes held (f32 and block forms).
    pub fn bytes(&self) -> usize {
        self.f32.len() * 4 + self.q.as_ref().map_or(0, QMatrix::bytes)
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    /// Q, K and V projections stacked: `[(n_heads + 2 n_kv_heads) head_dim][hidden]`.
    qkv: Linear,
    wo: Linear,
    ffn_norm: Vec<f32>,
    /// Gate and up projections stacked: `[2 ffn][hidden]`.
    gate_up: Linear,
    down: Linear,
}

/// Which logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last token's.
    Last,
    /// Every token's, `[n][vocab]`.
    All,
    /// The last `k` tokens', `[k][vocab]` (all of them when fewer were given).
    Tail(usize),
}

/// Timings of one forward call.
#[derive(Clone, Copy, Debug, Default)]
pub struct ForwardStats {
    /// Tokens processed.
    pub tokens: usize,
    /// Wall time in seconds.
    pub seconds: f64,
}

/// A loaded llama-family model.
pub struct Model {
    /// The model's shape.
    pub cfg: ModelConfig,
    path: PathBuf,
    /// Token embeddings `[vocab][hidden]`; `None` when tied to the output head.
    embed: Option<Vec<f32>>,
    layers: Vec<Layer>,
    out_norm: Vec<f32>,
    lm_head: Linear,
    rope: Rope,
    /// Tokens per prefill chunk: every batched forward call is cut to this size.
    pub prefill_chunk: usize,
}

fn read_weight(
    ct: &gguf_file::Content,
    file: &mut BufReader<File>,
    path: &Path,
    name: &str,
    expected: &[usize],
) -> Result<Weight, ModelError> {
    let info = ct
        .tensor_infos
        .get(name)
        .ok_or_else(|| ModelError::MissingTensor {
            path: path.into(),
            name: name.into(),
        })?;
    let dims = info.shape.dims().to_vec();
    if dims != expected {
        return Err(ModelError::Shape {
            name: name.into(),
            found: dims,
            expected: expected.to_vec(),
        });
    }
    let dtype = info.ggml_dtype;
    let q = ct
        .tensor(file, name, &Device::Cpu)
        .map_err(|e| ModelError::Gguf {
            path: path.into(),
            reason: format!("tensor {name:?}: {e}"),
        })?;
    let t = q
        .dequantize(&Device::Cpu)
        .map_err(|e| ModelError::TensorType {
            name: name.into(),
            dtype,
            reason: e.to_string(),
        })?;
    let f32 = t
        .flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(kernel)?;
    let (rows, cols) = match *expected {
        [r, c] => (r, c),
        [c] => (1, c),
        _ => (1, f32.len()),
    };
    let raw = match dtype {
        GgmlDType::Q4_1 => Some(QMatrix::from_q4_1(rows, cols, &q.data().map_err(kernel)?)),
        GgmlDType::Q8_0 => Some(QMatrix::from_q8_0(rows, cols, &q.data().map_err(kernel)?)),
        _ => None,
    };
    Ok(Weight {
        rows,
        cols,
        f32,
        raw,
    })
}

impl Model {
    /// Loads a llama-family GGUF file, repacking its weights.
    pub fn load(path: &Path) -> Result<Self, ModelError> {
        let io = |source| ModelError::Io {
            path: path.into(),
            source,
        };
        let f = File::open(path).map_err(io)?;
        let len = f.metadata().map_err(io)?.len();
        let mut file = BufReader::new(f);
        let ct = gguf_file::Content::read(&mut file).map_err(|e| ModelError::Gguf {
            path: path.into(),
            reason: e.to_string(),
        })?;
        // Check every tensor lies inside the file before reading any.
        for (name, info) in &ct.tensor_infos {
            let n = info.shape.elem_count() as u64;
            let bs = info.ggml_dtype.block_size() as u64;
            let end =
                ct.tensor_data_offset + info.offset + n / bs * info.ggml_dtype.type_size() as u64;
            if end > len {
                return Err(ModelError::Truncated {
                    path: path.into(),
                    tensor: name.clone(),
                    end,
                    len,
                });
            }
        }
        let cfg = ModelConfig::from_gguf(&ct).map_err(|source| ModelError::Config {
            path: path.into(),
            source,
        })?;
        let (h, hd, kvd) = (cfg.hidden, cfg.head_dim, cfg.kv_dim());
        let mut rd = |name: &str, dims: &[usize]| read_weight(&ct, &mut file, path, name, dims);
        let embed = rd("token_embd.weight", &[cfg.vocab, h])?;
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let p = |s: &str| format!("blk.{l}.{s}.weight");
            let qkv = Linear::stack(vec![
                rd(&p("attn_q"), &[cfg.n_heads * hd, h])?,
                rd(&p("attn_k"), &[kvd, h])?,
                rd(&p("attn_v"), &[kvd, h])?,
            ]);
            let gate_up = Linear::stack(vec![
                rd(&p("ffn_gate"), &[cfg.ffn, h])?,
                rd(&p("ffn_up"), &[cfg.ffn, h])?,
            ]);
            layers.push(Layer {
                attn_norm: rd(&p("attn_norm"), &[h])?.f32,
                qkv,
                wo: Linear::stack(vec![rd(&p("attn_output"), &[h, cfg.n_heads * hd])?]),
                ffn_norm: rd(&p("ffn_norm"), &[h])?.f32,
                gate_up,
                down: Linear::stack(vec![rd(&p("ffn_down"), &[h, cfg.ffn])?]),
            });
        }
        let out_norm = rd("output_norm.weight", &[h])?.f32;
        let (embed, lm_head) = if ct.tensor_infos.contains_key("output.weight") {
            let w = rd("output.weight", &[cfg.vocab, h])?;
            (Some(embed.f32), Linear::stack(vec![w]))
        } else {
            (None, Linear::stack(vec![embed]))
        };
        let rope = Rope::new(cfg.rope_dim, cfg.rope_base, cfg.max_ctx);
        tracing::info!(path = %path.display(), layers = cfg.n_layers, hidden = h, "model loaded");
        Ok(Self {
            cfg,
            path: path.into(),
            embed,
            layers,
            out_norm,
            lm_head,
            rope,
            prefill_chunk: 256,
        })
    }

    /// The file the model was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes of weights held in memory (all repacked forms).
    pub fn weight_bytes(&self) -> usize {
        let norms = (self.layers.len() * 2 + 1) * self.cfg.hidden * 4;
        let layers: usize = self
            .layers
            .iter()
            .map(|l| l.qkv.bytes() + l.wo.bytes() + l.gate_up.bytes() + l.down.bytes())
            .sum();
        norms
            + layers
            + self.lm_head.bytes()
            + self.embed.as_ref().map_or(0, |e| e.len() * 4)
            + self.rope.max_pos() * self.cfg.rope_dim * 4
    }

    /// The chunk shape of this model's KV cache with `tokens` tokens per chunk.
    pub fn chunk_shape(&self, tokens: usize) -> ChunkShape {
        ChunkShape {
            n_layers: self.cfg.n_layers,
            n_kv_heads: self.cfg.n_kv_heads,
            head_dim: self.cfg.head_dim,
            tokens,
        }
    }

    fn embedding(&self) -> &[f32] {
        self.embed.as_deref().unwrap_or(&self.lm_head.f32)
    }

    /// Runs `tokens` through the model after the tokens already in `cache`, appending their K/V
    /// to it, in prefill chunks of [`Model::prefill_chunk`] tokens. Returns the requested logits.
    pub fn forward(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        logits: Logits,
    ) -> Result<Vec<f32>, ModelError> {
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab) {
            return Err(ModelError::BadToken {
                id,
                vocab: self.cfg.vocab,
            });
        }
        if cache.len() + tokens.len() > self.rope.max_pos() {
            return Err(KvError::Full {
                len: cache.len(),
                adding: tokens.len(),
                max: self.rope.max_pos(),
            }
            .into());
        }
        let mut out = Vec::new();
        let total = tokens.len();
        let mut done = 0;
        for piece in tokens.chunks(self.prefill_chunk.max(1)) {
            done += piece.len();
            // How many of this piece's last tokens need logits.
            let rows = match logits {
                Logits::All => piece.len(),
                Logits::Last => usize::from(done == total),
                Logits::Tail(k) => piece.len().min((k + done).saturating_sub(total)),
            };
            out.extend(self.forward_batch(cache, piece, rows)?);
        }
        Ok(out)
    }

    fn embed_rows(&self, tokens: &[u32]) -> Vec<f32> {
        let (emb, h) = (self.embedding(), self.cfg.hidden);
        let mut x = Vec::with_capacity(tokens.len() * h);
        for &t in tokens {
            x.extend_from_slice(&emb[t as usize * h..(t as usize + 1) * h]);
        }
        x
    }

    /// Runs every layer over the `n` tokens at positions `p0..p0 + n` whose embeddings are `x`
    /// (updated in place to the last hidden state), writing their K/V into the cache and
    /// attending causally to every key at or before each position.
    fn run_layers(
        &self,
        cache: &mut KvCache,
        x: &mut [f32],
        p0: usize,
        n: usize,
    ) -> Result<(), ModelError> {
        let cfg = &self.cfg;
        let (h, hd, kvd) = (cfg.hidden, cfg.head_dim, cfg.kv_dim());
        let qd = cfg.n_heads * hd;
        let mut xn = vec![0.0; n * h];
        let mut qkv = vec![0.0; n * (qd + 2 * kvd)];
        let mut q = vec![0.0; n * qd];
        let mut att = vec![0.0; n * qd];
        let mut o = vec![0.0; n * h];
        let mut gu = vec![0.0; n * 2 * cfg.ffn];
        let mut act = vec![0.0; n * cfg.ffn];
        let shape = AttnShape {
            n_heads: cfg.n_heads,
            n_kv_heads: cfg.n_kv_heads,
            head_dim: hd,
        };
        for (li, layer) in self.layers.iter().enumerate() {
            rms_norm(&mut xn, x, &layer.attn_norm, cfg.rms_eps);
            layer.qkv.forward(&xn, n, &mut qkv);
            for (i, row) in qkv.chunks_exact_mut(qd + 2 * kvd).enumerate() {
                let pos = p0 + i;
                let (qr, kv) = row.split_at_mut(qd);
                let (kr, vr) = kv.split_at_mut(kvd);
                self.rope.apply(qr, hd, pos);
                self.rope.apply(kr, hd, pos);
                q[i * qd..(i + 1) * qd].copy_from_slice(qr);
                cache.write(li, pos, kr, vr);
            }
            attend(cache, li, shape, &q, p0, n, &mut att)?;
            layer.wo.forward(&att, n, &mut o);
            add_assign(x, &o);
            rms_norm(&mut xn, x, &layer.ffn_norm, cfg.rms_eps);
            layer.gate_up.forward(&xn, n, &mut gu);
            swiglu(&mut act, &gu, cfg.ffn);
            layer.down.forward(&act, n, &mut o);
            add_assign(x, &o);
        }
        Ok(())
    }

    /// Recomputes the K/V of `tokens` at their true positions `p0..p0 + tokens.len()` into the
    /// chunk the cache is recomputing ([`KvCache::begin_recompute`]), attending to every key
    /// before each position; nothing else in the cache changes.
    pub fn forward_positions(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        p0: usize,
    ) -> Result<(), ModelError> {
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab) {
            return Err(ModelError::BadToken {
                id,
                vocab: self.cfg.vocab,
            });
        }
        let mut x = self.embed_rows(tokens);
        self.run_layers(cache, &mut x, p0, tokens.len())
    }

    fn forward_batch(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        logit_rows: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let start = Instant::now();
        let cfg = &self.cfg;
        let (n, h) = (tokens.len(), cfg.hidden);
        let p0 = cache.len();
        cache.reserve(n)?;
        let mut x = self.embed_rows(tokens);
        self.run_layers(cache, &mut x, p0, n)?;
        cache.commit(tokens)?;
        let rows = logit_rows.min(n);
        let mut out = vec![0.0; rows * cfg.vocab];
        if rows > 0 {
            let mut xn = vec![0.0; rows * h];
            rms_norm(&mut xn, &x[(n - rows) * h..], &self.out_norm, cfg.rms_eps);
            self.lm_head.forward(&xn, rows, &mut out);
        }
        tracing::trace!(
            tokens = n,
            p0,
            secs = start.elapsed().as_secs_f64(),
            "forward batch"
        );
        Ok(out)
    }
}
