//! A llama-family model loaded from GGUF, its weights held once in the file's own blocks, and its
//! forward pass.
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

use crate::config::{ConfigError, ModelConfig};
use crate::int8gemm::{self, PrefillActs, QuantRows};
use crate::kernels::{Rope, add_assign, matmul_nt_tiled, rms_norm, swiglu};
use crate::kv::attention::{AttnShape, ChunkRows, PACKED_MAX_TOKENS, attend_chunks, attend_packed};
use crate::kv::{ChunkShape, KvCache, KvError};
use crate::qmatrix::{Activations, BLOCK, Kind, QMatrix};
use crate::stream::{Pass, StreamError, StreamUnit, WeightOptions, WeightSource, WeightStream};
use candle_core::Device;
use candle_core::quantized::{GgmlDType, gguf_file};
use policy::{StreamModel, WeightPlanError, WeightTensor};
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
enum Weight {
    Resident(QMatrix),
    Streamed(usize),
}

/// A weight matrix `[rows][cols]`, held once, in the file's own blocks ([`QMatrix`]), or
/// streamed from the file for every pass that uses it.
pub struct Linear {
    w: Weight,
    /// How single-row products take their activations.
    acts: Activations,
    /// How batched products take theirs (resolved: `F32` or `Int8`).
    batch: PrefillActs,
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
                w: Weight::Resident(QMatrix::stack(parts)),
                acts: Activations::default(),
                batch: PrefillActs::F32,
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
            w: Weight::Resident(requantize(rows, cols, f)),
            acts: Activations::default(),
            batch: PrefillActs::F32,
        }
    }

    fn streamed(id: usize) -> Self {
        Self {
            w: Weight::Streamed(id),
            acts: Activations::default(),
            batch: PrefillActs::F32,
        }
    }

    /// The held matrix (`None` when streamed).
    fn resident(&self) -> Option<&QMatrix> {
        match &self.w {
            Weight::Resident(q) => Some(q),
            Weight::Streamed(_) => None,
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
            Weight::Resident(q) => product(q, self.acts, self.batch, x, n, out),
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
        self.resident().map_or(0, QMatrix::bytes)
    }
}

/// `out[n][rows] = x[n][cols] · wᵀ`.
fn product(
    w: &QMatrix,
    acts: Activations,
    batch: PrefillActs,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    thread_local! {
        static QUANT: std::cell::RefCell<QuantRows> = std::cell::RefCell::new(QuantRows::default());
    }
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
            // Taken out, not borrowed, across the parallel product: a pool thread that waits
            // in it may run another product (another context's pass) meanwhile.
            let mut q = QUANT.take();
            q.quantize(x, n, cols);
            int8gemm::product(int8gemm::Path::best(), w, &q, out);
            QUANT.set(q);
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
fn tile_rows(cols: usize) -> usize {
    (TILE_BYTES / 4 / cols.max(1) / 16 * 16).max(16)
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
    /// Token embeddings `[vocab][hidden]`, dequantized a row at a time on lookup.
    embed: Embed,
    layers: Vec<Layer>,
    out_norm: Vec<f32>,
    /// The output head `[vocab][hidden]`: one matrix, or pieces of whole GEMM tiles of rows
    /// (first row, matrix) when it is streamed in part.
    head: Vec<(usize, Linear)>,
    /// Where the head's rows lie in the file (offset, kind), when it can be read a row at a time.
    head_file: Option<(u64, Kind)>,
    rope: Rope,
    /// Tokens per prefill chunk: every batched forward call is cut to this size.
    pub prefill_chunk: usize,
    /// Bytes of tensor data in the file (what the weights occupy on disk).
    file_tensor_bytes: usize,
    /// The streamed matrices, when the weights are held under a budget.
    stream: Option<WeightStream>,
    /// The streamed matrices of the layers and of the head, in the order a pass uses them.
    layer_ids: Vec<usize>,
    head_ids: Vec<usize>,
    holding: WeightHolding,
}

/// Where token embeddings come from.
enum Embed {
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
const DECODE_COMPUTE_BPS: f64 = 10e9;

/// Bytes read to measure the disk's read bandwidth at load.
const PROBE_BYTES: usize = 32 << 20;

/// A streamable matrix's kind and pieces of the file (offset, bytes).
type Located = (Kind, Vec<(u64, usize)>);

/// A matrix the loader may stream: the file tensors it is stacked from.
struct Candidate {
    /// (tensor name, expected dims) of each part, stacked in order.
    parts: Vec<(String, Vec<usize>)>,
}

/// The file's record of tensor `name`, checked to have the `expected` dims.
fn tensor_info<'a>(
    ct: &'a gguf_file::Content,
    path: &Path,
    name: &str,
    expected: &[usize],
) -> Result<&'a gguf_file::TensorInfo, ModelError> {
    let info = ct
        .tensor_infos
        .get(name)
        .ok_or_else(|| ModelError::MissingTensor {
            path: path.into(),
            name: name.into(),
        })?;
    let dims = info.shape.dims();
    if dims != expected {
        return Err(ModelError::Shape {
            name: name.into(),
            found: dims.to_vec(),
            expected: expected.to_vec(),
        });
    }
    Ok(info)
}

/// Where a tensor of `expected` dims lies and how it is stored, if the kernels read it as it is
/// (Q4_1, Q8_0): (offset in the file, kind, bytes).
fn locate(
    ct: &gguf_file::Content,
    path: &Path,
    name: &str,
    expected: &[usize],
) -> Result<Option<(u64, Kind, usize)>, ModelError> {
    let info = tensor_info(ct, path, name, expected)?;
    let kind = match info.ggml_dtype {
        GgmlDType::Q4_1 => Kind::Q4_1,
        GgmlDType::Q8_0 => Kind::Q8_0,
        _ => return Ok(None),
    };
    let n = info.shape.elem_count();
    if !n.is_multiple_of(BLOCK) || expected.len() != 2 || !expected[1].is_multiple_of(BLOCK) {
        return Ok(None);
    }
    let bytes = n / BLOCK * QMatrix::raw_unit(kind);
    Ok(Some((ct.tensor_data_offset + info.offset, kind, bytes)))
}

/// Measures the read bandwidth of `path` with `O_DIRECT` reads of 1 MiB from `start`.
fn probe_read_bps(path: &Path, start: u64, len: usize) -> Result<f64, ModelError> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let io = |source| ModelError::Io {
        path: path.into(),
        source,
    };
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::fcntl::OFlag::O_DIRECT.bits())
        .open(path)
        .map_err(io)?;
    const STEP: usize = 1 << 20;
    let align = crate::stream::DIRECT_ALIGN;
    let mut raw = vec![0u8; STEP + align];
    let at = raw.as_ptr().align_offset(align);
    let buf = &mut raw[at..at + STEP];
    let mut off = start / align as u64 * align as u64;
    let t = Instant::now();
    let mut done = 0;
    while done < len.max(STEP) {
        let n = f.read_at(buf, off).map_err(io)?;
        if n == 0 {
            break;
        }
        done += n;
        off += n as u64;
    }
    let secs = t.elapsed().as_secs_f64().max(1e-6);
    Ok(done as f64 / secs)
}

/// Drops the file's pages from the page cache (what loading the resident weights read).
fn drop_cache(path: &Path) {
    if let Ok(f) = File::open(path) {
        let _ = nix::fcntl::posix_fadvise(
            &f,
            0,
            0,
            nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
        );
    }
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
    let info = tensor_info(ct, path, name, expected)?;
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
    /// Loads a llama-family GGUF file, repacking its weights, all of them resident.
    pub fn load(path: &Path) -> Result<Self, ModelError> {
        Self::load_with(path, &WeightOptions::default())
    }

    /// Loads a llama-family GGUF file with its weights held as `opts` says: all resident, or
    /// under a budget with the rest streamed (the module docs of [`crate::stream`]).
    pub fn load_with(path: &Path, opts: &WeightOptions) -> Result<Self, ModelError> {
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
        let tied = !ct.tensor_infos.contains_key("output.weight");
        let head_name = if tied {
            "token_embd.weight"
        } else {
            "output.weight"
        };
        // The matrices of a pass, in the order it uses them: four per layer, then the head.
        let mut cands: Vec<Candidate> = Vec::new();
        for l in 0..cfg.n_layers {
            let p = |s: &str| format!("blk.{l}.{s}.weight");
            cands.push(Candidate {
                parts: vec![
                    (p("attn_q"), vec![cfg.n_heads * hd, h]),
                    (p("attn_k"), vec![kvd, h]),
                    (p("attn_v"), vec![kvd, h]),
                ],
            });
            cands.push(Candidate {
                parts: vec![(p("attn_output"), vec![h, cfg.n_heads * hd])],
            });
            cands.push(Candidate {
                parts: vec![
                    (p("ffn_gate"), vec![cfg.ffn, h]),
                    (p("ffn_up"), vec![cfg.ffn, h]),
                ],
            });
            cands.push(Candidate {
                parts: vec![(p("ffn_down"), vec![h, cfg.ffn])],
            });
        }
        // Where each candidate lies, if every part can be streamed as it is, in one kind.
        let mut located: Vec<Option<Located>> = Vec::new();
        for c in &cands {
            let mut pieces = Vec::new();
            let mut kind = None;
            for (name, dims) in &c.parts {
                match locate(&ct, path, name, dims)? {
                    Some((off, k, bytes)) if kind.is_none_or(|kk| kk == k) => {
                        kind = Some(k);
                        pieces.push((off, bytes));
                    }
                    _ => {
                        kind = None;
                        break;
                    }
                }
            }
            located.push(kind.map(|k| (k, pieces)));
        }
        let head_loc = locate(&ct, path, head_name, &[cfg.vocab, h])?;
        let head_file = head_loc.map(|(off, kind, _)| (off, kind));
        let rope = Rope::new(cfg.rope_dim, cfg.rope_base, cfg.max_ctx);
        let norm_bytes =
            ((cfg.n_layers * 2 + 1) * h * 4 + rope.max_pos() * cfg.rope_dim * 4) as u64;

        // Which candidates are streamed (by index; the head's pieces after the layers').
        let mut streamed = vec![false; cands.len()];
        let mut head_pieces: Vec<(usize, usize)> = vec![(0, cfg.vocab)];
        let mut head_streamed = vec![false];
        let mut holding = WeightHolding {
            budget: opts.budget,
            residency: "all".into(),
            ..WeightHolding::default()
        };
        let mut own_embed_from_file = false;
        // The stream's staging buffer in huge pages (faster reads), unless only small pages fit.
        let mut huge_staging = true;
        if let Some(budget) = opts.budget {
            let (mut fixed, mut total) = (norm_bytes, norm_bytes);
            let mut sizes = Vec::new();
            for (c, loc) in cands.iter().zip(&located) {
                let bytes: u64 = match loc {
                    Some((_, pieces)) => pieces.iter().map(|p| p.1 as u64).sum(),
                    None => {
                        // Held as read (or requantized): about its f32 size over 4 at most.
                        let b: u64 = c
                            .parts
                            .iter()
                            .map(|(n, _)| {
                                ct.tensor_infos.get(n).map_or(0, |i| {
                                    (i.shape.elem_count() / i.ggml_dtype.block_size()
                                        * i.ggml_dtype.type_size())
                                        as u64
                                })
                            })
                            .sum();
                        fixed += b;
                        b
                    }
                };
                total += bytes;
                sizes.push(bytes);
            }
            let head_bytes = head_loc.map_or(0, |x| x.2 as u64);
            total += head_bytes;
            let embed_bytes = if tied {
                0
            } else {
                ct.tensor_infos.get("token_embd.weight").map_or(0, |i| {
                    (i.shape.elem_count() / i.ggml_dtype.block_size() * i.ggml_dtype.type_size())
                        as u64
                })
            };
            total += embed_bytes;
            if head_loc.is_none() {
                fixed += head_bytes;
            }
            if budget < total || opts.source == WeightSource::Mmap {
                // A separate embedding is read a row at a time from the file when it can be.
                own_embed_from_file =
                    locate(&ct, path, "token_embd.weight", &[cfg.vocab, h])?.is_some();
                if !own_embed_from_file {
                    fixed += embed_bytes;
                }
                // The head in pieces of whole GEMM tiles no bigger than the largest layer
                // matrix, so it streams like a layer's matrices and its buffers stay small.
                if let Some((_, _, hb)) = head_loc {
                    let row_bytes = hb / cfg.vocab;
                    let biggest = sizes.iter().copied().max().unwrap_or(hb as u64) as usize;
                    let tile = tile_rows(h);
                    let rows = (biggest / row_bytes.max(1) / tile).max(1) * tile;
                    head_pieces = (0..cfg.vocab)
                        .step_by(rows)
                        .map(|r| (r, (r + rows).min(cfg.vocab)))
                        .collect();
                }
                // The planner's tensors: the streamable layer matrices, then the head pieces.
                let mut tensors = Vec::new();
                let mut which = Vec::new();
                for (i, loc) in located.iter().enumerate() {
                    if loc.is_some() {
                        tensors.push(WeightTensor {
                            kind: (i % 4) as u32,
                            bytes: sizes[i],
                            compute: sizes[i] as f64 / DECODE_COMPUTE_BPS,
                            reuse: 1,
                        });
                        which.push(Some(i));
                    }
                }
                if let Some((_, _, hb)) = head_loc {
                    let row_bytes = (hb / cfg.vocab) as u64;
                    for &(r0, r1) in &head_pieces {
                        let b = (r1 - r0) as u64 * row_bytes;
                        tensors.push(WeightTensor {
                            kind: 4,
                            bytes: b,
                            compute: b as f64 / DECODE_COMPUTE_BPS,
                            reuse: 1,
                        });
                        which.push(None);
                    }
                }
                let read_bps = match opts.read_bps {
                    Some(b) => b,
                    None => probe_read_bps(
                        path,
                        ct.tensor_data_offset,
                        PROBE_BYTES.min(file_tensor_bytes),
                    )?,
                };
                let huge = StreamModel {
                    read_bps,
                    latency: 50e-6,
                    slots: opts.slots.max(1),
                    staging: 2,
                    huge_page: kvfs::io::HUGE_PAGE as u64,
                };
                let small = StreamModel {
                    huge_page: 0,
                    ..huge
                };
                let resident: Vec<bool> = if opts.source == WeightSource::Mmap {
                    vec![false; tensors.len()]
                } else {
                    let room = budget.checked_sub(fixed);
                    let minimum = fixed + policy::min_budget(&tensors, &small);
                    let plan_with = |model: &StreamModel| {
                        room.ok_or(WeightPlanError::BelowMinimum { budget, minimum })
                            .and_then(|room| {
                                policy::plan_weights(&tensors, room, model, opts.residency)
                            })
                    };
                    // A budget that leaves no room to round the staging up to huge pages gets
                    // small ones.
                    let plan = plan_with(&huge)
                        .or_else(|e| match e {
                            WeightPlanError::BelowMinimum { .. } => {
                                huge_staging = false;
                                plan_with(&small)
                            }
                            e => Err(e),
                        })
                        .map_err(|e| match e {
                            WeightPlanError::BelowMinimum { .. } => ModelError::Budget {
                                budget,
                                minimum,
                                fixed,
                                stream: minimum - fixed,
                            },
                            e => ModelError::Plan(e),
                        })?;
                    holding.predicted_pass_secs = plan.predicted.pass_secs;
                    holding.predicted_stall_secs = plan.predicted.stall_secs;
                    plan.resident
                };
                holding.residency = match opts.source {
                    WeightSource::Mmap => "mmap".into(),
                    WeightSource::Direct => format!("{:?}", opts.residency).to_lowercase(),
                };
                holding.read_bps = read_bps;
                holding.fixed_bytes = fixed;
                head_streamed.clear();
                for (&r, w) in resident.iter().zip(&which) {
                    match w {
                        Some(i) => streamed[*i] = !r,
                        None => head_streamed.push(!r),
                    }
                }
                if head_loc.is_none() {
                    head_streamed = vec![false];
                }
            }
        }

        // Read what stays resident; describe what is streamed.
        let mut units: Vec<StreamUnit> = Vec::new();
        let mut rd = |name: &str, dims: &[usize]| read_weight(&ct, &mut file, path, name, dims);
        let mut layers = Vec::with_capacity(cfg.n_layers);
        let mut layer_ids = Vec::new();
        let mut mats: Vec<Linear> = Vec::with_capacity(4);
        for (i, c) in cands.iter().enumerate() {
            if streamed[i] {
                let (kind, pieces) = located[i].clone().expect("only located matrices stream");
                let rows = c.parts.iter().map(|(_, d)| d[0]).sum();
                layer_ids.push(units.len());
                mats.push(Linear::streamed(units.len()));
                units.push(StreamUnit {
                    kind,
                    rows,
                    cols: c.parts[0].1[1],
                    pieces,
                });
            } else {
                let parts = c
                    .parts
                    .iter()
                    .map(|(n, d)| rd(n, d))
                    .collect::<Result<Vec<_>, _>>()?;
                mats.push(Linear::stack(parts));
            }
            if mats.len() == 4 {
                let l = i / 4;
                let p = |s: &str| format!("blk.{l}.{s}.weight");
                let mut m = mats.drain(..);
                let (qkv, wo, gate_up, down) = (
                    m.next().expect("4 matrices"),
                    m.next().expect("4 matrices"),
                    m.next().expect("4 matrices"),
                    m.next().expect("4 matrices"),
                );
                drop(m);
                layers.push(Layer {
                    attn_norm: to_vector(rd(&p("attn_norm"), &[h])?),
                    qkv,
                    wo,
                    ffn_norm: to_vector(rd(&p("ffn_norm"), &[h])?),
                    gate_up,
                    down,
                });
            }
        }
        let out_norm = to_vector(rd("output_norm.weight", &[h])?);
        let mut head = Vec::new();
        let mut head_ids = Vec::new();
        if head_pieces.len() == 1 && !head_streamed[0] {
            head.push((0, Linear::stack(vec![rd(head_name, &[cfg.vocab, h])?])));
        } else {
            let (off, kind, hb) = head_loc.expect("only a located head is cut in pieces");
            let row_bytes = hb / cfg.vocab;
            for (&(r0, r1), &s) in head_pieces.iter().zip(&head_streamed) {
                let piece = (off + (r0 * row_bytes) as u64, (r1 - r0) * row_bytes);
                if s {
                    head_ids.push(units.len());
                    head.push((r0, Linear::streamed(units.len())));
                    units.push(StreamUnit {
                        kind,
                        rows: r1 - r0,
                        cols: h,
                        pieces: vec![piece],
                    });
                } else {
                    use std::os::unix::fs::FileExt;
                    let mut raw = vec![0u8; piece.1];
                    File::open(path)
                        .and_then(|f| f.read_exact_at(&mut raw, piece.0))
                        .map_err(io)?;
                    let q = QMatrix::from_raw(r1 - r0, h, kind, &raw);
                    head.push((r0, Linear::stack(vec![q])));
                }
            }
        }
        let embed = if tied {
            Embed::Tied
        } else if own_embed_from_file {
            let (off, kind, _) =
                locate(&ct, path, "token_embd.weight", &[cfg.vocab, h])?.expect("checked above");
            Embed::File(off, kind)
        } else {
            Embed::Own(rd("token_embd.weight", &[cfg.vocab, h])?)
        };
        let stream = if !units.is_empty() || own_embed_from_file {
            // What loading read through the page cache leaves it; streamed bytes never enter.
            drop_cache(path);
            holding.streamed_matrices = units.len();
            holding.streamed_bytes_per_token = units.iter().map(|u| u.bytes() as u64).sum();
            Some(WeightStream::start(
                path,
                units,
                opts.source,
                opts.slots,
                huge_staging,
            )?)
        } else {
            None
        };
        holding.buffer_bytes = stream.as_ref().map_or(0, |s| s.buffer_bytes() as u64);
        tracing::info!(path = %path.display(), layers = cfg.n_layers, hidden = h, "model loaded");
        let mut model = Self {
            cfg,
            path: path.into(),
            embed,
            layers,
            out_norm,
            head,
            head_file,
            rope,
            prefill_chunk: 256,
            file_tensor_bytes,
            stream,
            layer_ids,
            head_ids,
            holding,
        };
        let matrices: usize = model.matrices().map(QMatrix::bytes).sum::<usize>()
            + match &model.embed {
                Embed::Own(q) => q.bytes(),
                _ => 0,
            };
        model.holding.resident_bytes = matrices as u64;
        if let Some(budget) = opts.budget {
            let held = model.weight_bytes() as u64 + model.holding.buffer_bytes;
            tracing::info!(
                budget,
                held,
                resident = model.holding.resident_bytes,
                buffers = model.holding.buffer_bytes,
                streamed = model.holding.streamed_bytes_per_token,
                residency = %model.holding.residency,
                "weights under a budget"
            );
            if held > budget && opts.source == WeightSource::Direct {
                return Err(ModelError::Budget {
                    budget,
                    minimum: held,
                    fixed: model.holding.fixed_bytes,
                    stream: model.holding.buffer_bytes,
                });
            }
        }
        Ok(model)
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
        let norms = (self.layers.len() * 2 + 1) * self.cfg.hidden * 4;
        let layers: usize = self
            .layers
            .iter()
            .map(|l| l.qkv.bytes() + l.wo.bytes() + l.gate_up.bytes() + l.down.bytes())
            .sum();
        let own_embed = match &self.embed {
            Embed::Own(q) => q.bytes(),
            _ => 0,
        };
        norms
            + layers
            + self.head.iter().map(|(_, l)| l.bytes()).sum::<usize>()
            + own_embed
            + self.rope.max_pos() * self.cfg.rope_dim * 4
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
    /// int8 where the CPU has 8-bit dot products (AVX-512 VNNI), f32 elsewhere.
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
    fn matrices(&self) -> impl Iterator<Item = &QMatrix> {
        self.layers
            .iter()
            .flat_map(|l| [&l.qkv, &l.wo, &l.gate_up, &l.down])
            .chain(self.head.iter().map(|(_, l)| l))
            .filter_map(Linear::resident)
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
            let row_bytes = h / BLOCK * QMatrix::raw_unit(file.1);
            stream.read_raw(file.0 + (t * row_bytes) as u64, row_bytes, &mut raw)?;
            QMatrix::from_raw(1, h, file.1, &raw).dequant_rows(0, 1, row);
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
    /// queries see earlier chunks sealed and their own in f32.
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
        let shape = AttnShape {
            n_heads: cfg.n_heads,
            n_kv_heads: cfg.n_kv_heads,
            head_dim: hd,
        };
        for (li, layer) in self.layers.iter().enumerate() {
            rms_norm(&mut xn, x, &layer.attn_norm, cfg.rms_eps);
            layer.qkv.forward(pass, &xn, n, &mut qkv)?;
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
            layer.wo.forward(pass, &att, n, &mut o)?;
            add_assign(x, &o);
            rms_norm(&mut xn, x, &layer.ffn_norm, cfg.rms_eps);
            layer.gate_up.forward(pass, &xn, n, &mut gu)?;
            swiglu(&mut act, &gu, cfg.ffn);
            layer.down.forward(pass, &act, n, &mut o)?;
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
