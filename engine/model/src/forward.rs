//! A model loaded from GGUF, its weights held once in the file's own blocks, and its forward
//! pass: one pass for every [`Family`](crate::config::Family), which says what a layer does
//! beyond llama's (biases, per-head norms, post-norms, the gate, sliding windows, RoPE style).
//!
//! No weight matrix is ever held as f32: single-token products read the blocks directly
//! ([`QMatrix::matvec`]); batched products (prefill, recompute, scoring) multiply int8
//! activations with the weights' own codes where the CPU has 8-bit dot products
//! ([`crate::int8gemm`]), or dequantize the weights a small tile at a time and multiply
//! each tile with f32 GEMM (the reference); embeddings are dequantized on lookup.
//! The prompt is prefilled in fixed-size steps, so one set of shapes serves every length.
//!
//! Prefill and recompute are one batched pass ([`Model::forward`], [`Model::forward_chunks`]),
//! block-causal by KV chunk: at each layer, the chunks the pass completes are sealed first, then
//! each chunk's queries attend to every earlier chunk in its sealed form and to their own chunk
//! in f32, the rule decode follows too. With every GEMM's rounding independent of the batch
//! ([`crate::kernels::GEMM_DEPTH`]), a sealed chunk's bytes never depend on the step size
//! or on which chunks were recomputed together, so recompute after any prefill is exact. The
//! cost: a step's chunks see each other quantized rather than in f32, and are encoded a layer
//! at a time as the pass runs rather than once at its end (the same work).

use crate::config::{Activation, ConfigError, ModelConfig};
use crate::int8gemm::{self, PrefillActs, QuantRows};
use crate::kernels::{
    add_assign, geglu, matmul_nt_tiled, rms_norm, rms_norm_in_place, rows_par, swiglu,
};
use crate::kv::attention::{AttnShape, ChunkRows, PACKED_MAX_TOKENS, attend_chunks, attend_packed};
use crate::kv::{ChunkShape, KvCache, KvError};
use crate::qmatrix::{Activations, BLOCK, Kind, QMatrix};
use crate::rope::{Rope, RopeAngles};
use crate::stream::{Pass, StreamError, StreamUnit, WeightStream};
use candle_core::quantized::GgmlDType;
use policy::WeightPlanError;
use rayon::prelude::*;
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
    /// The metadata does not describe a supported model. (The error is a field of the message,
    /// not its `source`: an error chain printed whole would say it twice.)
    #[error("{path}: {error}")]
    Config { path: PathBuf, error: ConfigError },
    /// A tensor the architecture needs is absent.
    #[error("{path} has no tensor {name:?}")]
    MissingTensor { path: PathBuf, name: String },
    /// A tensor has the wrong shape.
    #[error("{path}: tensor {name:?} has shape {found:?}, expected {expected:?}")]
    Shape {
        path: PathBuf,
        name: String,
        found: Vec<usize>,
        expected: Vec<usize>,
    },
    /// A tensor's type cannot be converted.
    #[error("{path}: tensor {name:?} of type {dtype:?} cannot be loaded: {reason}")]
    TensorType {
        path: PathBuf,
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
    /// The weights do not fit the budget.
    #[error(
        "a weight budget of {budget} bytes is below this model's minimum working set of {minimum} bytes (norms and tables {fixed}, stream buffers for every matrix {stream}); give at least {minimum}"
    )]
    Budget {
        budget: u64,
        minimum: u64,
        fixed: u64,
        stream: u64,
    },
    /// The weight plan could not be made.
    #[error("cannot plan the weights: {0}")]
    Plan(WeightPlanError),
    /// A streamed weight could not be read.
    #[error(transparent)]
    Stream(#[from] StreamError),
}

/// A weight matrix's bytes: held, or streamed per pass (its id in the [`WeightStream`]).
pub(crate) enum Weight {
    /// Held: one matrix, or (a stack of tensors of different kinds, such as a Q4_K_M file's
    /// Q4_K queries and Q6_K values) its row ranges in order, each in its own blocks.
    Resident(Vec<QMatrix>),
    Streamed(usize),
}

/// A weight matrix `[rows][cols]`, held once, in the file's own blocks ([`QMatrix`]), or
/// streamed from the file for every pass that uses it.
pub struct Linear {
    pub(crate) w: Weight,
    /// How single-row products take their activations.
    pub(crate) acts: Activations,
    /// How batched products take theirs (resolved: `F32` or `Int8`).
    pub(crate) batch: PrefillActs,
}

/// Rows below which a product is a matrix-vector product per row (weights read once per row,
/// dequantized in registers) rather than a GEMM over dequantized tiles.
pub(crate) const GEMM_MIN_ROWS: usize = 4;

/// Bytes of f32 weights one GEMM tile holds (dequantized on the fly, reused per thread): small
/// enough to stay in L2 next to the activations it multiplies.
pub(crate) const TILE_BYTES: usize = 192 * 1024;

impl Linear {
    /// Stacks weights with equal column counts, rows after rows. Matrices of one block kind are
    /// one matrix; a mix of kinds stays a list of row ranges, each in its own blocks (never
    /// requantized: one product per range, written to its rows of the output).
    pub(crate) fn stack(parts: Vec<QMatrix>) -> Self {
        let held = if parts.windows(2).all(|w| w[0].kind() == w[1].kind()) {
            vec![QMatrix::stack(parts)]
        } else {
            // Runs of one kind stacked, so a Q4_K Q and K with a Q6_K V make two ranges.
            let mut runs: Vec<Vec<QMatrix>> = Vec::new();
            for p in parts {
                match runs.last_mut() {
                    Some(run) if run[0].kind() == p.kind() => run.push(p),
                    _ => runs.push(vec![p]),
                }
            }
            runs.into_iter().map(QMatrix::stack).collect()
        };
        Self {
            w: Weight::Resident(held),
            acts: Activations::default(),
            batch: PrefillActs::F32,
        }
    }

    pub(crate) fn streamed(id: usize) -> Self {
        Self {
            w: Weight::Streamed(id),
            acts: Activations::default(),
            batch: PrefillActs::F32,
        }
    }

    /// The held matrix (`None` when streamed or held as ranges of different kinds).
    pub(crate) fn resident(&self) -> Option<&QMatrix> {
        match self.parts() {
            [q] => Some(q),
            _ => None,
        }
    }

    /// The held matrices: one, or the row ranges of a stack of different kinds (none when
    /// streamed).
    pub(crate) fn parts(&self) -> &[QMatrix] {
        match &self.w {
            Weight::Resident(q) => q,
            Weight::Streamed(_) => &[],
        }
    }

    /// `out[n][rows] = x[n][cols] · selfᵀ`, a streamed matrix taken from `pass`.
    fn forward(
        &self,
        pass: &mut Option<Pass<'_>>,
        x: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> Result<(), ModelError> {
        match &self.w {
            Weight::Resident(parts) => product_parts(parts, self.acts, self.batch, x, n, out),
            Weight::Streamed(id) => {
                let p = pass.as_mut().ok_or(StreamError::Order {
                    expected: usize::MAX,
                    got: *id,
                })?;
                let q = p.fetch(*id)?;
                product(&q, self.acts, self.batch, x, n, out);
            }
        }
        Ok(())
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.parts().iter().map(QMatrix::bytes).sum()
    }
}

/// `out[n][rows] = x[n][cols] · wᵀ` for `w` the row ranges `parts`: each range's product into
/// its own rows of `out` (through a scratch buffer when `n > 1`, as the rows interleave).
fn product_parts(
    parts: &[QMatrix],
    acts: Activations,
    batch: PrefillActs,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    if let [w] = parts {
        return product(w, acts, batch, x, n, out);
    }
    if n == 1 && parts.iter().all(|w| w.as_f32().is_none()) {
        // A decode step: every part's rows in one parallel loop.
        return QMatrix::matvec_parts(parts, acts, x, out);
    }
    if batch == PrefillActs::Int8
        && n >= GEMM_MIN_ROWS
        && parts.iter().all(|w| w.as_f32().is_none())
    {
        // The activations quantized once, every part's rows in one parallel loop, each
        // writing its own columns of `out`.
        return int8_product(x, (n, parts[0].cols()), out, |q, out| {
            int8gemm::product_parts(int8gemm::Path::best(), parts, q, out)
        });
    }
    let rows: usize = parts.iter().map(QMatrix::rows).sum();
    let mut r0 = 0;
    for w in parts {
        let rp = w.rows();
        if n == 1 {
            product(w, acts, batch, x, 1, &mut out[r0..r0 + rp]);
        } else {
            let mut part = vec![0.0; n * rp];
            product(w, acts, batch, x, n, &mut part);
            for (o, p) in out.chunks_exact_mut(rows).zip(part.chunks_exact(rp)) {
                o[r0..r0 + rp].copy_from_slice(p);
            }
        }
        r0 += rp;
    }
}

/// Quantizes `x` (`n` rows) into this thread's activation buffer and runs `f` on it.
fn int8_product(
    x: &[f32],
    (n, cols): (usize, usize),
    out: &mut [f32],
    f: impl FnOnce(&QuantRows, &mut [f32]),
) {
    thread_local! {
        static QUANT: std::cell::RefCell<QuantRows> = std::cell::RefCell::new(QuantRows::default());
    }
    // Taken out, not borrowed, across the parallel product: a pool thread that waits in it may
    // run another product (another context's pass) meanwhile.
    let mut q = QUANT.take();
    q.quantize(x, n, cols);
    f(&q, out);
    QUANT.set(q);
}

/// `out[n][rows] = x[n][cols] · wᵀ`.
pub(crate) fn product(
    w: &QMatrix,
    acts: Activations,
    batch: PrefillActs,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    {
        let (rows, cols) = (w.rows(), w.cols());
        if let Some(f) = w.as_f32() {
            let tile = (TILE_BYTES / 4 / cols.max(1) / 16 * 16).max(16);
            matmul_nt_tiled(out, x, n, rows, cols, tile, |r0, r1, buf| {
                buf.copy_from_slice(&f[r0 * cols..r1 * cols])
            });
        } else if n < GEMM_MIN_ROWS {
            for i in 0..n {
                w.matvec(
                    acts,
                    &x[i * cols..(i + 1) * cols],
                    &mut out[i * rows..(i + 1) * rows],
                );
            }
        } else if batch == PrefillActs::Int8 {
            int8_product(x, (n, cols), out, |q, out| {
                int8gemm::product(int8gemm::Path::best(), w, q, out)
            });
        } else {
            let tile = tile_rows(cols);
            matmul_nt_tiled(out, x, n, rows, cols, tile, |r0, r1, buf| {
                w.dequant_rows(r0, r1, buf)
            });
        }
    }
}

/// Rows of one GEMM tile for matrices of `cols` columns; a matrix cut into pieces of whole
/// tiles gives the same products as the whole matrix.
pub(crate) fn tile_rows(cols: usize) -> usize {
    (TILE_BYTES / 4 / cols.max(1) / 16 * 16).max(16)
}

/// f32 weights from a type the kernels do not read directly: Q8_0 when rows split in blocks
/// (near-lossless, 8.5 bits per weight), else f32.
pub(crate) fn requantize(rows: usize, cols: usize, f: Vec<f32>) -> QMatrix {
    if cols.is_multiple_of(BLOCK) {
        QMatrix::quantize_q8_0(rows, cols, &f)
    } else {
        QMatrix::from_f32(rows, cols, f)
    }
}

pub(crate) struct Layer {
    pub(crate) attn_norm: Vec<f32>,
    /// Q, K and V projections stacked: `[(n_heads + 2 n_kv_heads) head_dim][hidden]`.
    pub(crate) qkv: Linear,
    /// The Q, K and V biases, stacked as `qkv` (qwen2).
    pub(crate) qkv_bias: Option<Vec<f32>>,
    /// Per-head RMSNorm weights of queries and of keys, `[head_dim]` each (gemma3).
    pub(crate) qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    pub(crate) wo: Linear,
    /// RMSNorm of the attention output before it joins the residual stream (gemma3).
    pub(crate) post_attn_norm: Option<Vec<f32>>,
    pub(crate) ffn_norm: Vec<f32>,
    /// Gate and up projections stacked: `[2 ffn][hidden]`.
    pub(crate) gate_up: Linear,
    pub(crate) down: Linear,
    /// RMSNorm of the feed-forward output before it joins the residual stream (gemma3).
    pub(crate) post_ffn_norm: Option<Vec<f32>>,
    /// Tokens this layer attends to when it is a sliding-window layer; `None` when global.
    pub(crate) window: Option<usize>,
    /// Which of [`Model::ropes`] turns this layer's queries and keys.
    pub(crate) rope: usize,
}

impl Layer {
    /// Bytes of the layer's vectors (norms and biases).
    fn vector_bytes(&self) -> usize {
        let opt = |v: &Option<Vec<f32>>| v.as_ref().map_or(0, Vec::len);
        let qk = self.qk_norm.as_ref().map_or(0, |(q, k)| q.len() + k.len());
        4 * (self.attn_norm.len()
            + self.ffn_norm.len()
            + opt(&self.qkv_bias)
            + qk
            + opt(&self.post_attn_norm)
            + opt(&self.post_ffn_norm))
    }
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

/// A loaded model.
pub struct Model {
    /// The model's shape.
    pub cfg: ModelConfig,
    pub(crate) path: PathBuf,
    /// Token embeddings `[vocab][hidden]`, dequantized a row at a time on lookup.
    pub(crate) embed: Embed,
    pub(crate) layers: Vec<Layer>,
    pub(crate) out_norm: Vec<f32>,
    /// The output head `[vocab][hidden]`: one matrix, or pieces of whole GEMM tiles of rows
    /// (first row, matrix) when it is streamed in part.
    pub(crate) head: Vec<(usize, Linear)>,
    /// Where the head's rows lie in the file (offset, kind), when it can be read a row at a time.
    pub(crate) head_file: Option<(u64, Kind)>,
    /// The RoPEs the layers use: the global layers', then the sliding-window layers' when the
    /// model has a window.
    pub(crate) ropes: Vec<Rope>,
    /// What embeddings are multiplied by on lookup (`sqrt(hidden)` for gemma, else 1).
    pub(crate) embed_scale: f32,
    /// Tokens per prefill chunk: every batched forward call is cut to this size
    /// ([`crate::config::ModelConfig::prefill_step`] by default).
    pub prefill_chunk: usize,
    /// Bytes of tensor data in the file (what the weights occupy on disk).
    pub(crate) file_tensor_bytes: usize,
    /// The streamed matrices, when the weights are held under a budget.
    pub(crate) stream: Option<WeightStream>,
    /// The streamed matrices of the layers and of the head, in the order a pass uses them.
    pub(crate) layer_ids: Vec<usize>,
    pub(crate) head_ids: Vec<usize>,
    pub(crate) holding: WeightHolding,
    /// The thread moving the resident weights into huge pages after load, until
    /// [`Model::settle_huge_pages`] has waited for it.
    pub(crate) huge_pages: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// Where token embeddings come from.
pub(crate) enum Embed {
    /// The output head's rows.
    Tied,
    /// A matrix of their own.
    Own(QMatrix),
    /// A row read from the file per lookup (offset of the tensor, its kind).
    File(u64, Kind),
}

/// How the weights are held: what [`Model::holding`] reports.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct WeightHolding {
    /// The budget they are held under, if any.
    pub budget: Option<u64>,
    /// How the resident matrices were chosen (`all` without a budget).
    pub residency: String,
    /// Bytes of norms, tables and matrices that cannot be streamed.
    pub fixed_bytes: u64,
    /// Bytes of the weight matrices held (those the plan keeps, and any that cannot stream).
    pub resident_bytes: u64,
    /// Bytes of the stream's buffers (ring and staging).
    pub buffer_bytes: u64,
    /// Bytes of streamed matrices a decode pass reads (layers and head).
    pub streamed_bytes_per_token: u64,
    /// Matrices streamed.
    pub streamed_matrices: usize,
    /// Read bandwidth the plan assumed, bytes/s (measured at load unless given).
    pub read_bps: f64,
    /// The plan's predicted seconds per decode pass and stall within it.
    pub predicted_pass_secs: f64,
    pub predicted_stall_secs: f64,
}

/// Bytes/s a decode step's products run at, for the plan's compute time per matrix (decode
/// streams the weights from memory at about this rate on this class of CPU: docs/bench-engine.md).
pub(crate) const DECODE_COMPUTE_BPS: f64 = 10e9;

/// Bytes read to measure the disk's read bandwidth at load.
pub(crate) const PROBE_BYTES: usize = 32 << 20;

impl Model {
    /// Waits until the resident weights are in huge pages (the thread load starts for it,
    /// a few hundred milliseconds): benchmarks call it so that no timed run shares the cores
    /// with that copy. The model is usable meanwhile, so nothing else needs to.
    pub fn settle_huge_pages(&self) {
        let handle = self
            .huge_pages
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(h) = handle {
            let _ = h.join();
        }
    }

    /// How the weights are held, and what the stream has read so far.
    pub fn holding(&self) -> WeightHolding {
        self.holding.clone()
    }

    /// The weight stream's counters (`None` with every weight resident).
    pub fn stream_counters(&self) -> Option<&crate::stream::StreamCounters> {
        self.stream.as_ref().map(WeightStream::counters)
    }

    /// The file the model was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes of weights held in memory (all repacked forms; not the stream's buffers).
    pub fn weight_bytes(&self) -> usize {
        let norms =
            self.layers.iter().map(Layer::vector_bytes).sum::<usize>() + self.cfg.hidden * 4;
        let layers: usize = self
            .layers
            .iter()
            .map(|l| l.qkv.bytes() + l.wo.bytes() + l.gate_up.bytes() + l.down.bytes())
            .sum();
        let own_embed = match &self.embed {
            Embed::Own(q) => q.bytes(),
            _ => 0,
        };
        norms + layers + self.head.iter().map(|(_, l)| l.bytes()).sum::<usize>() + own_embed
    }

    /// How single-token products take their activations (every matrix of the model).
    pub fn set_activations(&mut self, acts: Activations) {
        for l in &mut self.layers {
            for lin in [&mut l.qkv, &mut l.wo, &mut l.gate_up, &mut l.down] {
                lin.acts = acts;
            }
        }
        for (_, lin) in &mut self.head {
            lin.acts = acts;
        }
    }

    /// How batched products (prefill, recompute, scoring) take their activations; `Auto` is
    /// int8 on every vector path (AVX-512 VNNI, AVX-VNNI, AVX2), f32 on the portable one.
    pub fn set_prefill_activations(&mut self, batch: PrefillActs) {
        let batch = batch.resolve();
        for l in &mut self.layers {
            for lin in [&mut l.qkv, &mut l.wo, &mut l.gate_up, &mut l.down] {
                lin.batch = batch;
            }
        }
        for (_, lin) in &mut self.head {
            lin.batch = batch;
        }
    }

    /// How batched products take their activations (`F32` or `Int8`).
    pub fn prefill_activations(&self) -> PrefillActs {
        self.head[0].1.batch
    }

    /// How single-token products take their activations.
    pub fn activations(&self) -> Activations {
        self.head[0].1.acts
    }

    /// Bytes of tensor data in the GGUF file the model was loaded from.
    pub fn file_tensor_bytes(&self) -> usize {
        self.file_tensor_bytes
    }

    /// Weight bytes one decode step reads: every layer's matrices and the output head (the
    /// norms and one embedding row are noise), resident or streamed.
    pub fn decode_weight_bytes(&self) -> usize {
        self.matrices().map(|m| m.bytes()).sum::<usize>()
            + self
                .stream
                .as_ref()
                .map_or(0, |s| s.units().iter().map(StreamUnit::bytes).sum())
    }

    /// The resident matrices a decode step reads.
    pub(crate) fn matrices(&self) -> impl Iterator<Item = &QMatrix> {
        self.layers
            .iter()
            .flat_map(|l| [&l.qkv, &l.wo, &l.gate_up, &l.down])
            .chain(self.head.iter().map(|(_, l)| l))
            .flat_map(Linear::parts)
    }

    /// Reads every byte of the decode weights once on the engine's threads and returns a
    /// checksum: the memory read bandwidth a decode step can reach, measured on its own data.
    pub fn stream_weights(&self) -> u64 {
        let ms: Vec<&QMatrix> = self.matrices().collect();
        ms.par_iter()
            .map(|m| m.sum_bytes())
            .reduce(|| 0, u64::wrapping_add)
    }

    /// The chunk shape of this model's KV cache with `tokens` tokens per chunk.
    pub fn chunk_shape(&self, tokens: usize) -> ChunkShape {
        self.cfg.chunk_shape(tokens)
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
        if cache.len() + tokens.len() > self.cfg.max_ctx {
            return Err(KvError::Full {
                len: cache.len(),
                adding: tokens.len(),
                max: self.cfg.max_ctx,
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

    fn embed_rows(&self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        let h = self.cfg.hidden;
        let mut x = vec![0.0; tokens.len() * h];
        let mut raw = Vec::new();
        for (&t, row) in tokens.iter().zip(x.chunks_exact_mut(h)) {
            let t = t as usize;
            let file = match &self.embed {
                Embed::Own(q) => {
                    q.dequant_rows(t, t + 1, row);
                    continue;
                }
                Embed::File(off, kind) => (*off, *kind),
                Embed::Tied => {
                    // The head piece that holds row t, if resident.
                    let i = self.head.partition_point(|(r0, _)| *r0 <= t) - 1;
                    let (r0, lin) = &self.head[i];
                    if let Some(q) = lin.resident() {
                        q.dequant_rows(t - r0, t - r0 + 1, row);
                        continue;
                    }
                    self.head_file
                        .expect("a streamed head has its place in the file")
                }
            };
            // One row from the file, past the page cache.
            let stream = self
                .stream
                .as_ref()
                .expect("rows are read from a stream's file");
            let row_bytes = file.1.bytes_of(h);
            stream.read_raw(file.0 + (t * row_bytes) as u64, row_bytes, &mut raw)?;
            QMatrix::from_raw(1, h, file.1, &raw).dequant_rows(0, 1, row);
        }
        if self.embed_scale != 1.0 {
            x.iter_mut().for_each(|v| *v *= self.embed_scale);
        }
        Ok(x)
    }

    /// Starts a pass over the streamed matrices of the layers, and of the head if `head`.
    fn begin_pass(&self, head: bool) -> Result<Option<Pass<'_>>, ModelError> {
        let Some(stream) = &self.stream else {
            return Ok(None);
        };
        let mut ids = self.layer_ids.clone();
        if head {
            ids.extend(&self.head_ids);
        }
        Ok(Some(stream.begin(ids)?))
    }

    /// The logits of the rows `xn` (`[rows][hidden]`, normed) into `out` (`[rows][vocab]`).
    fn head_forward(
        &self,
        pass: &mut Option<Pass<'_>>,
        xn: &[f32],
        rows: usize,
        out: &mut [f32],
    ) -> Result<(), ModelError> {
        if let [(_, lin)] = &self.head[..] {
            return lin.forward(pass, xn, rows, out);
        }
        let vocab = self.cfg.vocab;
        let mut part = Vec::new();
        for (i, (r0, lin)) in self.head.iter().enumerate() {
            let r1 = self.head.get(i + 1).map_or(vocab, |p| p.0);
            let w = r1 - r0;
            part.resize(rows * w, 0.0);
            lin.forward(pass, xn, rows, &mut part)?;
            for (o, p) in out.chunks_exact_mut(vocab).zip(part.chunks_exact(w)) {
                o[*r0..r1].copy_from_slice(p);
            }
        }
        Ok(())
    }

    /// Runs every layer over the tokens at `positions` (ascending) whose embeddings are `x`
    /// (updated in place to the last hidden state), writing their K/V into the cache. A few
    /// contiguous tokens (decode) attend to the cache as it is; a batch attends block-causally
    /// ([`attend_chunks`]): at each layer, once every row's K/V is written, the chunks in `seal`
    /// (those the batch completes) are encoded ([`KvCache::seal_layer`]), then each chunk's
    /// queries see earlier chunks sealed and their own in f32, and the layer's f32 of those
    /// chunks is freed ([`KvCache::release_layer`]).
    fn run_layers(
        &self,
        cache: &mut KvCache,
        x: &mut [f32],
        positions: &[usize],
        seal: &[usize],
        pass: &mut Option<Pass<'_>>,
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
        let angles: Vec<RopeAngles> = self.ropes.iter().map(|r| r.angles(positions)).collect();
        for (li, layer) in self.layers.iter().enumerate() {
            let shape = AttnShape {
                n_heads: cfg.n_heads,
                n_kv_heads: cfg.n_kv_heads,
                head_dim: hd,
                window: layer.window,
            };
            rms_norm(&mut xn, x, &layer.attn_norm, cfg.rms_eps);
            layer.qkv.forward(pass, &xn, n, &mut qkv)?;
            let rope = &self.ropes[layer.rope];
            // Each token's query and key: bias, norms and rotation, row by row on the
            // engine's threads (a prefill step's rows are independent).
            let stride = qd + 2 * kvd;
            rows_par(&mut qkv, stride, |rows, first| {
                for (j, row) in rows.chunks_exact_mut(stride).enumerate() {
                    let i = first + j;
                    if let Some(b) = &layer.qkv_bias {
                        add_assign(row, b);
                    }
                    let (qr, kv) = row.split_at_mut(qd);
                    let kr = &mut kv[..kvd];
                    if let Some((qn, kn)) = &layer.qk_norm {
                        rms_norm_in_place(qr, qn, cfg.rms_eps);
                        rms_norm_in_place(kr, kn, cfg.rms_eps);
                    }
                    rope.apply(qr, hd, &angles[layer.rope], i);
                    rope.apply(kr, hd, &angles[layer.rope], i);
                }
            });
            for (i, row) in qkv.chunks_exact(stride).enumerate() {
                let (qr, kv) = row.split_at(qd);
                let (kr, vr) = kv.split_at(kvd);
                q[i * qd..(i + 1) * qd].copy_from_slice(qr);
                cache.write(li, positions[i], kr, vr);
            }
            if batched {
                for &c in seal {
                    cache.seal_layer(li, c)?;
                }
                attend_chunks(cache, li, shape, &q, &chunk_rows, &mut att)?;
                for &c in seal {
                    cache.release_layer(li, c);
                }
            } else {
                attend_packed(cache, li, shape, &q, positions[0], n, &mut att)?;
            }
            layer.wo.forward(pass, &att, n, &mut o)?;
            if let Some(w) = &layer.post_attn_norm {
                rms_norm_in_place(&mut o, w, cfg.rms_eps);
            }
            add_assign(x, &o);
            rms_norm(&mut xn, x, &layer.ffn_norm, cfg.rms_eps);
            layer.gate_up.forward(pass, &xn, n, &mut gu)?;
            match cfg.family.activation {
                Activation::Silu => swiglu(&mut act, &gu, cfg.ffn),
                Activation::GeluTanh => geglu(&mut act, &gu, cfg.ffn),
            }
            layer.down.forward(pass, &act, n, &mut o)?;
            if let Some(w) = &layer.post_ffn_norm {
                rms_norm_in_place(&mut o, w, cfg.rms_eps);
            }
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
        let mut x = self.embed_rows(&tokens)?;
        cache.begin_recompute(chunks)?;
        let run = on_pool(|| {
            let mut pass = self.begin_pass(false)?;
            self.run_layers(cache, &mut x, &positions, chunks, &mut pass)
        })
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
        let mut x = self.embed_rows(tokens)?;
        let t = cache.shape().tokens;
        let positions: Vec<usize> = (p0..p0 + n).collect();
        // The chunks this batch completes are sealed layer by layer as it runs.
        let seal: Vec<usize> = (p0 / t..(p0 + n) / t).collect();
        let rows = logit_rows.min(n);
        let mut pass = self.begin_pass(rows > 0)?;
        self.run_layers(cache, &mut x, &positions, &seal, &mut pass)?;
        cache.commit(tokens)?;
        let mut out = vec![0.0; rows * cfg.vocab];
        if rows > 0 {
            let mut xn = vec![0.0; rows * h];
            rms_norm(&mut xn, &x[(n - rows) * h..], &self.out_norm, cfg.rms_eps);
            self.head_forward(&mut pass, &xn, rows, &mut out)?;
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

/// Runs `f` on one of the engine's pool threads (at once when already on one).
///
/// A decode step runs about five parallel loops per layer (the four products and attention),
/// 150 on the default model. Started from a thread outside the pool (the daemon's engine thread,
/// a tool's main thread), each loop is queued into the pool and its caller sleeps until a worker
/// has finished it: two thread wake-ups per loop, and three threads on the engine's cores.
/// Started from a pool thread, a loop runs its first part on that thread at once and the
/// other workers take the rest, so the step pays one hand-over in all.
///
/// For as long as `f` runs, the pool's other workers are kept polling for its loops' work
/// ([`hot`]).
pub fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        hot(f)
    } else {
        rayon::scope(|_| hot(f))
    }
}

/// How long a worker kept hot polls without finding work before it gives up and may sleep.
const HOT_IDLE: std::time::Duration = std::time::Duration::from_micros(500);

/// Workers polling for a pass's work right now ([`on_pool`]).
static HOT_WORKERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many workers are polling for the work of a pass in [`on_pool`] right now, in every
/// pool: 0 whenever no pass runs (or once each has idled [`HOT_IDLE`]).
pub fn hot_workers() -> usize {
    HOT_WORKERS.load(std::sync::atomic::Ordering::Acquire)
}

/// Runs `f` on this pool thread with every other worker of the pool polling for work
/// (`rayon::yield_now`) until `f` returns, or until it has found none for [`HOT_IDLE`].
///
/// Between two of a pass's parallel loops the calling thread works alone for a few to some
/// tens of microseconds (norms, RoPE, the KV append, the head's sampling outside). A rayon
/// worker that finds no work yields the CPU some rounds and then sleeps; a loop started after
/// that waits for a wake-up, and once the gap reaches about 20 µs the sleeping worker takes
/// its share late or not at all (measured: two tasks of 25 µs each behind a serial gap of
/// 40 µs ran slower than one thread running both). Kept polling, a worker takes its share
/// within a microsecond. The poll stops with the pass, so an idle engine sleeps as before.
fn hot<R>(f: impl FnOnce() -> R) -> R {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    thread_local! {
        /// Whether this thread runs a pass that already keeps the others polling (a pass
        /// within a pass broadcasts nothing more).
        static HOT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    if rayon::current_num_threads() < 2 || HOT.get() {
        return f();
    }
    /// Ends the poll when the pass ends, also by a panic.
    struct Done(Arc<AtomicBool>);
    impl Drop for Done {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
            HOT.set(false);
        }
    }
    let me = rayon::current_thread_index();
    let done = Done(Arc::new(AtomicBool::new(false)));
    let flag = Arc::clone(&done.0);
    HOT.set(true);
    rayon::spawn_broadcast(move |ctx| {
        if Some(ctx.index()) == me {
            return;
        }
        HOT_WORKERS.fetch_add(1, Ordering::AcqRel);
        let mut idle_since = None;
        while !flag.load(Ordering::Acquire) {
            match rayon::yield_now() {
                Some(rayon::Yield::Executed) => idle_since = None,
                _ => {
                    let t = *idle_since.get_or_insert_with(std::time::Instant::now);
                    if t.elapsed() > HOT_IDLE {
                        break;
                    }
                    std::hint::spin_loop();
                }
            }
        }
        HOT_WORKERS.fetch_sub(1, Ordering::AcqRel);
    });
    // `done` ends the poll as it drops, after `f` has returned or unwound.
    f()
}
