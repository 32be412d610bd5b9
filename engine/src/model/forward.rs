//! A llama-family model loaded from GGUF, its weights held once in the file's own blocks, and its
//! forward pass.
//!
//! No weight matrix is ever held as f32: single-token products read the blocks directly
//! ([`QMatrix::matvec`]); batched products (prefill, recompute, scoring) dequantize the weights a
//! small tile at a time and multiply each tile with f32 GEMM; embeddings are dequantized on lookup.
//! The prompt is prefilled in fixed-size steps, so one set of shapes serves every length.
//!
//! Prefill and recompute are one batched pass ([`Model::forward`], [`Model::forward_chunks`]),
//! block-causal by KV chunk: at each layer, the chunks the pass completes are sealed first, then
//! each chunk's queries attend to every earlier chunk in its sealed form and to their own chunk
//! in f32, the rule decode follows too. With every GEMM's rounding independent of the batch
//! ([`crate::model::kernels::GEMM_DEPTH`]), a sealed chunk's bytes never depend on the step size
//! or on which chunks were recomputed together, so recompute after any prefill is exact. The
//! cost: a step's chunks see each other quantized rather than in f32, and are encoded a layer
//! at a time as the pass runs rather than once at its end (the same work).

use crate::kv::attention::{AttnShape, ChunkRows, PACKED_MAX_TOKENS, attend_chunks, attend_packed};
use crate::kv::{ChunkShape, KvCache, KvError};
use crate::model::config::{ConfigError, ModelConfig};
use crate::model::kernels::{Rope, add_assign, matmul_nt_tiled, rms_norm, swiglu};
use crate::model::qmatrix::{Activations, BLOCK, Kind, QMatrix};
use candle_core::Device;
use candle_core::quantized::{GgmlDType, gguf_file};
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
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

/// A weight matrix `[rows][cols]`, held once, in the file's own blocks ([`QMatrix`]).
pub struct Linear {
    w: QMatrix,
    /// How single-row products take their activations.
    acts: Activations,
}

/// Rows below which a product is a matrix-vector product per row (weights read once per row,
/// dequantized in registers) rather than a GEMM over dequantized tiles.
const GEMM_MIN_ROWS: usize = 4;

/// Bytes of f32 weights one GEMM tile holds (dequantized on the fly, reused per thread): small
/// enough to stay in L2 next to the activations it multiplies.
const TILE_BYTES: usize = 192 * 1024;

impl Linear {
    /// Stacks weights with equal column counts, rows after rows. Matrices of one block kind stay
    /// as they are; a mix is requantized to Q8_0 (or kept f32 if rows do not split in blocks).
    fn stack(parts: Vec<QMatrix>) -> Self {
        if parts.windows(2).all(|w| w[0].kind() == w[1].kind()) {
            return Self {
                w: QMatrix::stack(parts),
                acts: Activations::default(),
            };
        }
        let cols = parts[0].cols();
        let rows = parts.iter().map(QMatrix::rows).sum();
        let mut f = vec![0.0; rows * cols];
        let mut r = 0;
        for p in &parts {
            p.dequant_rows(0, p.rows(), &mut f[r * cols..]);
            r += p.rows();
        }
        Self {
            w: requantize(rows, cols, f),
            acts: Activations::default(),
        }
    }

    /// `out[n][rows] = x[n][cols] · selfᵀ`.
    pub fn forward(&self, x: &[f32], n: usize, out: &mut [f32]) {
        let (rows, cols) = (self.w.rows(), self.w.cols());
        if let Some(f) = self.w.as_f32() {
            let tile = (TILE_BYTES / 4 / cols.max(1) / 16 * 16).max(16);
            matmul_nt_tiled(out, x, n, rows, cols, tile, |r0, r1, buf| {
                buf.copy_from_slice(&f[r0 * cols..r1 * cols])
            });
        } else if n < GEMM_MIN_ROWS {
            for i in 0..n {
                self.w.matvec(
                    self.acts,
                    &x[i * cols..(i + 1) * cols],
                    &mut out[i * rows..(i + 1) * rows],
                );
            }
        } else {
            let tile = (TILE_BYTES / 4 / cols.max(1) / 16 * 16).max(16);
            matmul_nt_tiled(out, x, n, rows, cols, tile, |r0, r1, buf| {
                self.w.dequant_rows(r0, r1, buf)
            });
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.w.bytes()
    }
}

/// f32 weights from a type the kernels do not read directly: Q8_0 when rows split in blocks
/// (near-lossless, 8.5 bits per weight), else f32.
fn requantize(rows: usize, cols: usize, f: Vec<f32>) -> QMatrix {
    if cols.is_multiple_of(BLOCK) {
        QMatrix::quantize_q8_0(rows, cols, &f)
    } else {
        QMatrix::from_f32(rows, cols, f)
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
    /// Token embeddings `[vocab][hidden]`, dequantized a row at a time on lookup; `None` when
    /// tied to the output head.
    embed: Option<QMatrix>,
    layers: Vec<Layer>,
    out_norm: Vec<f32>,
    lm_head: Linear,
    rope: Rope,
    /// Tokens per prefill chunk: every batched forward call is cut to this size.
    pub prefill_chunk: usize,
    /// Bytes of tensor data in the file (what the weights occupy on disk).
    file_tensor_bytes: usize,
}

/// Reads one tensor of `expected` dims (`[rows, cols]` or `[cols]`) straight from the file into
/// its blocks, a piece at a time, so no tensor is ever in memory twice; types the kernels do not
/// read are dequantized by candle and requantized.
fn read_weight(
    ct: &gguf_file::Content,
    file: &mut BufReader<File>,
    path: &Path,
    name: &str,
    expected: &[usize],
) -> Result<QMatrix, ModelError> {
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
    let (rows, cols) = match *expected {
        [r, c] => (r, c),
        [c] => (1, c),
        _ => (1, info.shape.elem_count()),
    };
    let dtype = info.ggml_dtype;
    let kind = match dtype {
        GgmlDType::Q4_1 => Some(Kind::Q4_1),
        GgmlDType::Q8_0 => Some(Kind::Q8_0),
        GgmlDType::F32 => Some(Kind::F32),
        _ => None,
    };
    let gguf = |e: String| ModelError::Gguf {
        path: path.into(),
        reason: format!("tensor {name:?}: {e}"),
    };
    let Some(kind) = kind else {
        let q = ct
            .tensor(file, name, &Device::Cpu)
            .map_err(|e| gguf(e.to_string()))?;
        let f = q
            .dequantize(&Device::Cpu)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(|e| ModelError::TensorType {
                name: name.into(),
                dtype,
                reason: e.to_string(),
            })?;
        return Ok(if rows == 1 {
            QMatrix::from_f32(rows, cols, f)
        } else {
            requantize(rows, cols, f)
        });
    };
    let units = if kind == Kind::F32 {
        rows * cols
    } else {
        rows * cols / BLOCK
    };
    let unit = QMatrix::raw_unit(kind);
    file.seek(SeekFrom::Start(ct.tensor_data_offset + info.offset))
        .map_err(|e| gguf(e.to_string()))?;
    let mut q = QMatrix::with_capacity(rows, cols, kind);
    let mut buf = vec![0u8; unit * 4096];
    let mut left = units;
    while left > 0 {
        let take = left.min(4096);
        file.read_exact(&mut buf[..take * unit])
            .map_err(|e| gguf(e.to_string()))?;
        q.push_raw(&buf[..take * unit]);
        left -= take;
    }
    Ok(q)
}

/// Runs `f` on one of the engine's pool threads (at once when already on one).
///
/// A decode step runs about five parallel loops per layer (the four products and attention),
/// 150 on the default model. Started from a thread outside the pool (the daemon's engine thread,
/// a tool's main thread), each loop is queued into the pool and its caller sleeps until a worker
/// has finished it: two thread wake-ups per loop, and three threads on the engine's cores.
/// Started from a pool thread, a loop runs its first part on that thread at once and the
/// other workers take the rest, so the step pays one hand-over in all.
fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        f()
    } else {
        rayon::scope(|_| f())
    }
}

/// A norm's weights as f32.
fn to_vector(w: QMatrix) -> Vec<f32> {
    let mut f = vec![0.0; w.rows() * w.cols()];
    w.dequant_rows(0, w.rows(), &mut f);
    f
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
        let mut file_tensor_bytes = 0;
        for (name, info) in &ct.tensor_infos {
            let n = info.shape.elem_count() as u64;
            let bs = info.ggml_dtype.block_size() as u64;
            let bytes = n / bs * info.ggml_dtype.type_size() as u64;
            file_tensor_bytes += bytes as usize;
            let end = ct.tensor_data_offset + info.offset + bytes;
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
                attn_norm: to_vector(rd(&p("attn_norm"), &[h])?),
                qkv,
                wo: Linear::stack(vec![rd(&p("attn_output"), &[h, cfg.n_heads * hd])?]),
                ffn_norm: to_vector(rd(&p("ffn_norm"), &[h])?),
                gate_up,
                down: Linear::stack(vec![rd(&p("ffn_down"), &[h, cfg.ffn])?]),
            });
        }
        let out_norm = to_vector(rd("output_norm.weight", &[h])?);
        let (embed, lm_head) = if ct.tensor_infos.contains_key("output.weight") {
            let w = rd("output.weight", &[cfg.vocab, h])?;
            (Some(embed), Linear::stack(vec![w]))
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
            file_tensor_bytes,
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
            + self.embed.as_ref().map_or(0, QMatrix::bytes)
            + self.rope.max_pos() * self.cfg.rope_dim * 4
    }

    /// How single-token products take their activations (every matrix of the model).
    pub fn set_activations(&mut self, acts: Activations) {
        for l in &mut self.layers {
            for lin in [&mut l.qkv, &mut l.wo, &mut l.gate_up, &mut l.down] {
                lin.acts = acts;
            }
        }
        self.lm_head.acts = acts;
    }

    /// How single-token products take their activations.
    pub fn activations(&self) -> Activations {
        self.lm_head.acts
    }

    /// Bytes of tensor data in the GGUF file the model was loaded from.
    pub fn file_tensor_bytes(&self) -> usize {
        self.file_tensor_bytes
    }

    /// Weight bytes one decode step reads: every layer's matrices and the output head (the
    /// norms and one embedding row are noise).
    pub fn decode_weight_bytes(&self) -> usize {
        self.matrices().map(|m| m.bytes()).sum()
    }

    fn matrices(&self) -> impl Iterator<Item = &QMatrix> {
        self.layers
            .iter()
            .flat_map(|l| [&l.qkv.w, &l.wo.w, &l.gate_up.w, &l.down.w])
            .chain([&self.lm_head.w])
    }

    /// Reads every byte of the decode weights once on the engine's threads and returns a
    /// checksum: the memory read bandwidth a decode step can reach, measured on its own data.
    pub fn stream_weights(&self) -> u64 {
        use rayon::prelude::*;
        let ms: Vec<&QMatrix> = self.matrices().collect();
        ms.par_iter()
            .map(|m| m.sum_bytes())
            .reduce(|| 0, u64::wrapping_add)
    }

    /// The chunk shape of this model's KV cache with `tokens` tokens per chunk.
    pub fn chunk_shape(&self, tokens: usize) -> ChunkShape {
        self.cfg.chunk_shape(tokens)
    }

    fn embedding(&self) -> &QMatrix {
        self.embed.as_ref().unwrap_or(&self.lm_head.w)
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
        on_pool(|| {
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
        })
    }

    fn embed_rows(&self, tokens: &[u32]) -> Vec<f32> {
        let (emb, h) = (self.embedding(), self.cfg.hidden);
        let mut x = vec![0.0; tokens.len() * h];
        for (&t, row) in tokens.iter().zip(x.chunks_exact_mut(h)) {
            emb.dequant_rows(t as usize, t as usize + 1, row);
        }
        x
    }

    /// Runs every layer over the tokens at `positions` (ascending) whose embeddings are `x`
    /// (updated in place to the last hidden state), writing their K/V into the cache. A few
    /// contiguous tokens (decode) attend to the cache as it is; a batch attends block-causally
    /// ([`attend_chunks`]): at each layer, once every row's K/V is written, the chunks in `seal`
    /// (those the batch completes) are encoded ([`KvCache::seal_layer`]), then each chunk's
    /// queries see earlier chunks sealed and their own in f32.
    fn run_layers(
        &self,
        cache: &mut KvCache,
        x: &mut [f32],
        positions: &[usize],
        seal: &[usize],
    ) -> Result<(), ModelError> {
        let n = positions.len();
        let batched = n > PACKED_MAX_TOKENS;
        let chunk_rows = ChunkRows::of(positions, cache.shape().tokens);
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
                let pos = positions[i];
                let (qr, kv) = row.split_at_mut(qd);
                let (kr, vr) = kv.split_at_mut(kvd);
                self.rope.apply(qr, hd, pos);
                self.rope.apply(kr, hd, pos);
                q[i * qd..(i + 1) * qd].copy_from_slice(qr);
                cache.write(li, pos, kr, vr);
            }
            if batched {
                for &c in seal {
                    cache.seal_layer(li, c)?;
                }
                attend_chunks(cache, li, shape, &q, &chunk_rows, &mut att)?;
            } else {
                attend_packed(cache, li, shape, &q, positions[0], n, &mut att)?;
            }
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

    /// Recomputes the K/V of the sealed chunks `chunks` (ascending) in one batched pass from
    /// their token ids, at their true positions, and seals each into its slot in its recorded
    /// format ([`KvCache::begin_recompute`]). Every chunk before the last one must be resident
    /// or in the set; attention is block-causal as in prefill, so each rebuilt chunk equals what
    /// a batched prefill made of it, bit for bit. Nothing else in the cache changes.
    pub fn forward_chunks(&self, cache: &mut KvCache, chunks: &[usize]) -> Result<(), ModelError> {
        let t = cache.shape().tokens;
        let mut tokens = Vec::with_capacity(chunks.len() * t);
        let mut positions = Vec::with_capacity(chunks.len() * t);
        for &c in chunks {
            let ids = cache
                .tokens()
                .get(c * t..(c + 1) * t)
                .ok_or(KvError::NotSealed {
                    index: c,
                    sealed: cache.chunk_formats().len(),
                })?;
            tokens.extend_from_slice(ids);
            positions.extend(c * t..(c + 1) * t);
        }
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab) {
            return Err(ModelError::BadToken {
                id,
                vocab: self.cfg.vocab,
            });
        }
        cache.begin_recompute(chunks)?;
        let mut x = self.embed_rows(&tokens);
        let run = on_pool(|| self.run_layers(cache, &mut x, &positions, chunks))
            .and_then(|()| cache.finish_recompute().map_err(ModelError::from));
        if run.is_err() {
            cache.abort_recompute();
        }
        run
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
        let t = cache.shape().tokens;
        let positions: Vec<usize> = (p0..p0 + n).collect();
        // The chunks this batch completes are sealed layer by layer as it runs.
        let seal: Vec<usize> = (p0 / t..(p0 + n) / t).collect();
        self.run_layers(cache, &mut x, &positions, &seal)?;
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
