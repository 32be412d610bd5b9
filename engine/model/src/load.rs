//! Loading a GGUF file into the engine's layout: each tensor read a piece at a time and held in
//! its own blocks (or repacked to them), QKV and gate-up stacked, the weight budget planned
//! (`policy::plan_weights`) and the matrices that do not fit handed to the weight stream.

use crate::config::ModelConfig;
use crate::qmatrix::{Kind, QMatrix};
use crate::rope::Rope;
use crate::stream::{StreamUnit, WeightOptions, WeightSource, WeightStream};
use candle_core::Device;
use candle_core::quantized::gguf_file;
use policy::{StreamModel, WeightPlanError, WeightTensor};
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::Path;
use std::time::Instant;

use crate::forward::*;

/// A streamable matrix's kind and pieces of the file (offset, bytes).
type Located = (Kind, Vec<(u64, usize)>);

/// The output head's pieces: each piece's first row and its matrix.
type HeadPieces = Vec<(usize, Linear)>;

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
            path: path.into(),
            name: name.into(),
            found: dims.to_vec(),
            expected: expected.to_vec(),
        });
    }
    Ok(info)
}

/// Where a tensor of `expected` dims lies and how it is stored, if the kernels read it as it is
/// (any block [`Kind`]): (offset in the file, kind, bytes).
fn locate(
    ct: &gguf_file::Content,
    path: &Path,
    name: &str,
    expected: &[usize],
) -> Result<Option<(u64, Kind, usize)>, ModelError> {
    let info = tensor_info(ct, path, name, expected)?;
    let kind = match Kind::from_ggml(info.ggml_dtype) {
        Some(Kind::F32) | None => return Ok(None),
        Some(k) => k,
    };
    let n = info.shape.elem_count();
    let vals = kind.block_values();
    if !n.is_multiple_of(vals) || expected.len() != 2 || !expected[1].is_multiple_of(vals) {
        return Ok(None);
    }
    let bytes = kind.bytes_of(n);
    Ok(Some((ct.tensor_data_offset + info.offset, kind, bytes)))
}

/// What a candle error says, once: without the backtrace candle may carry along
/// (`RUST_BACKTRACE`), and an unknown tensor type named as one.
fn reason(e: candle_core::Error) -> String {
    let inner = match e {
        candle_core::Error::WithBacktrace { inner, .. } => *inner,
        e => e,
    };
    let msg = inner.to_string();
    match msg.strip_prefix("unknown dtype for tensor ") {
        Some(id) => format!(
            "a tensor has ggml type {id}, which this engine does not read (it reads F32, F16, \
             BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q2_K to Q6_K)"
        ),
        None => msg,
    }
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
/// read (F16, BF16, Q2_K, Q3_K) are dequantized by candle and requantized to Q8_0.
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
    // A row must be whole blocks (ggml's rule too); a vector of blocks is dequantized.
    let kind = Kind::from_ggml(dtype).filter(|k| cols.is_multiple_of(k.block_values()));
    let gguf = |e: String| ModelError::Gguf {
        path: path.into(),
        reason: format!("tensor {name:?}: {e}"),
    };
    let Some(kind) = kind else {
        let q = ct
            .tensor(file, name, &Device::Cpu)
            .map_err(|e| gguf(reason(e)))?;
        let f = q
            .dequantize(&Device::Cpu)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(|e| ModelError::TensorType {
                path: path.into(),
                name: name.into(),
                dtype,
                reason: reason(e),
            })?;
        return Ok(if rows == 1 {
            QMatrix::from_f32(rows, cols, f)
        } else {
            requantize(rows, cols, f)
        });
    };
    let units = rows * cols / kind.block_values();
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

/// A norm's weights as f32.
fn to_vector(w: QMatrix) -> Vec<f32> {
    let mut f = vec![0.0; w.rows() * w.cols()];
    w.dequant_rows(0, w.rows(), &mut f);
    f
}

impl Model {
    /// Loads a GGUF file of one of the [`Family`](crate::config::Family)s, all its weights resident.
    pub fn load(path: &Path) -> Result<Self, ModelError> {
        Self::load_with(path, &WeightOptions::default())
    }

    /// Loads a GGUF file with its weights held as `opts` says: all resident, or
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
            reason: reason(e),
        })?;
        let file_tensor_bytes = check_bounds(&ct, path, len)?;
        let cfg = ModelConfig::from_gguf(&ct).map_err(|error| ModelError::Config {
            path: path.into(),
            error,
        })?;
        let h = cfg.hidden;
        let tied = !ct.tensor_infos.contains_key("output.weight");
        let head_name = if tied {
            "token_embd.weight"
        } else {
            "output.weight"
        };
        let cands = candidates(&cfg);
        let located = cands
            .iter()
            .map(|c| locate_candidate(&ct, path, c))
            .collect::<Result<Vec<_>, _>>()?;
        let head_loc = locate(&ct, path, head_name, &[cfg.vocab, h])?;
        let norm_bytes = cfg.vector_bytes() as u64;
        let residency = plan_residency(
            &Layout {
                ct: &ct,
                path,
                cfg: &cfg,
                cands: &cands,
                located: &located,
                head_loc,
                tied,
                norm_bytes,
                file_tensor_bytes,
            },
            opts,
        )?;

        // Read what stays resident; describe what is streamed.
        let mut reader = Reader {
            ct: &ct,
            file: &mut file,
            path,
            units: Vec::new(),
        };
        let ropes = reader.ropes(&cfg)?;
        let (layers, layer_ids) = reader.layers(&cfg, &cands, &located, &residency.streamed)?;
        let out_norm = to_vector(reader.read("output_norm.weight", &[h])?);
        let (head, head_ids) = reader.head(&cfg, head_name, head_loc, &residency)?;
        let embed = reader.embed(&cfg, tied, residency.own_embed_from_file)?;
        let units = reader.units;
        let mut holding = residency.holding;
        let stream = if !units.is_empty() || residency.own_embed_from_file {
            // What loading read through the page cache leaves it; streamed bytes never enter.
            drop_cache(path);
            holding.streamed_matrices = units.len();
            holding.streamed_bytes_per_token = units.iter().map(|u| u.bytes() as u64).sum();
            Some(WeightStream::start(
                path,
                units,
                opts.source,
                opts.slots,
                residency.huge_staging,
            )?)
        } else {
            None
        };
        holding.buffer_bytes = stream.as_ref().map_or(0, |s| s.buffer_bytes() as u64);
        tracing::info!(path = %path.display(), layers = cfg.n_layers, hidden = h, "model loaded");
        let embed_scale = cfg.embed_scale();
        let prefill_chunk = cfg.prefill_step();
        let model = Self {
            cfg,
            path: path.into(),
            embed,
            layers,
            out_norm,
            head,
            head_file: head_loc.map(|(off, kind, _)| (off, kind)),
            ropes,
            embed_scale,
            prefill_chunk,
            file_tensor_bytes,
            stream,
            layer_ids,
            head_ids,
            holding,
            huge_pages: Default::default(),
        };
        model.within_budget(opts)
    }

    /// Counts the resident matrices' bytes and checks the weights fit `opts.budget` (a direct
    /// stream cannot hold less than its fixed part and buffers).
    fn within_budget(mut self, opts: &WeightOptions) -> Result<Self, ModelError> {
        let matrices: usize = self.matrices().map(QMatrix::bytes).sum::<usize>()
            + match &self.embed {
                Embed::Own(q) => q.bytes(),
                _ => 0,
            };
        self.holding.resident_bytes = matrices as u64;
        // The resident weights into huge pages, on a thread of its own: the copy takes a few
        // hundred milliseconds, and the model is usable meanwhile (the contents never change).
        let buffers: Vec<(usize, usize)> = self
            .matrices()
            .flat_map(QMatrix::buffers)
            .chain(match &self.embed {
                Embed::Own(q) => q.buffers().to_vec(),
                _ => Vec::new(),
            })
            .collect();
        let collapse = std::thread::Builder::new()
            .name("huge-pages".into())
            .spawn(move || {
                let t = std::time::Instant::now();
                let regions = crate::simd::collapse_to_huge_pages(buffers);
                let ms = t.elapsed().as_secs_f64() * 1e3;
                tracing::debug!(regions, ms, "weights in huge pages");
            });
        *self.huge_pages.get_mut().unwrap_or_else(|e| e.into_inner()) = collapse.ok();
        if let Some(budget) = opts.budget {
            let held = self.weight_bytes() as u64 + self.holding.buffer_bytes;
            tracing::info!(
                budget,
                held,
                resident = self.holding.resident_bytes,
                buffers = self.holding.buffer_bytes,
                streamed = self.holding.streamed_bytes_per_token,
                residency = %self.holding.residency,
                "weights under a budget"
            );
            if held > budget && opts.source == WeightSource::Direct {
                return Err(ModelError::Budget {
                    budget,
                    minimum: held,
                    fixed: self.holding.fixed_bytes,
                    stream: self.holding.buffer_bytes,
                });
            }
        }
        Ok(self)
    }
}

/// Checks every tensor lies inside the file (of `len` bytes) before any is read; returns the
/// bytes of all tensors.
fn check_bounds(ct: &gguf_file::Content, path: &Path, len: u64) -> Result<usize, ModelError> {
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
    Ok(file_tensor_bytes)
}

/// The matrices of a pass, in the order it uses them: four per layer (QKV, output, gate-up,
/// down), each stacked from its file tensors.
fn candidates(cfg: &ModelConfig) -> Vec<Candidate> {
    let (h, hd, kvd) = (cfg.hidden, cfg.head_dim, cfg.kv_dim());
    let mut cands = Vec::with_capacity(cfg.n_layers * 4);
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
    cands
}

/// Where a candidate lies, if every part can be streamed as it is, all of one kind.
fn locate_candidate(
    ct: &gguf_file::Content,
    path: &Path,
    c: &Candidate,
) -> Result<Option<Located>, ModelError> {
    let mut pieces = Vec::new();
    let mut kind = None;
    for (name, dims) in &c.parts {
        match locate(ct, path, name, dims)? {
            Some((off, k, bytes)) if kind.is_none_or(|kk| kk == k) => {
                kind = Some(k);
                pieces.push((off, bytes));
            }
            _ => return Ok(None),
        }
    }
    Ok(kind.map(|k| (k, pieces)))
}

/// Reads the resident weights from the file and describes the streamed ones (`units`).
struct Reader<'a> {
    ct: &'a gguf_file::Content,
    file: &'a mut BufReader<File>,
    path: &'a Path,
    /// The streamed matrices, in the order a pass reads them.
    units: Vec<StreamUnit>,
}

impl Reader<'_> {
    /// One tensor of `dims`, read into its blocks.
    fn read(&mut self, name: &str, dims: &[usize]) -> Result<QMatrix, ModelError> {
        read_weight(self.ct, self.file, self.path, name, dims)
    }

    /// A vector of `len` values (a norm's weights, a bias) as f32.
    fn vector(&mut self, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
        Ok(to_vector(self.read(name, &[len])?))
    }

    /// The RoPEs of the layers: the global layers' (scaled linearly, and by the file's
    /// `rope_freqs` factors when it has them: Llama 3), then, with a window, the sliding-window
    /// layers' (their own base, never scaled: Gemma 3's local layers are not).
    fn ropes(&mut self, cfg: &ModelConfig) -> Result<Vec<Rope>, ModelError> {
        let factors = if self.ct.tensor_infos.contains_key("rope_freqs.weight") {
            Some(self.vector("rope_freqs.weight", cfg.rope_dim / 2)?)
        } else {
            None
        };
        let style = cfg.family.rope_style;
        let mut ropes = vec![Rope::new(
            cfg.rope_dim,
            cfg.rope_base,
            style,
            cfg.rope_freq_scale,
            factors.as_deref(),
        )];
        if cfg.window.is_some() {
            ropes.push(Rope::new(
                cfg.rope_dim,
                cfg.rope_base_local,
                style,
                1.0,
                None,
            ));
        }
        Ok(ropes)
    }

    /// A streamed matrix: its unit appended, the matrix naming it.
    fn stream(
        &mut self,
        kind: Kind,
        rows: usize,
        cols: usize,
        pieces: Vec<(u64, usize)>,
    ) -> Linear {
        let id = self.units.len();
        self.units.push(StreamUnit {
            kind,
            rows,
            cols,
            pieces,
        });
        Linear::streamed(id)
    }

    /// The layers, each candidate read (stacked) or streamed as `streamed` says; returns them
    /// with the ids of the streamed units among them.
    fn layers(
        &mut self,
        cfg: &ModelConfig,
        cands: &[Candidate],
        located: &[Option<Located>],
        streamed: &[bool],
    ) -> Result<(Vec<Layer>, Vec<usize>), ModelError> {
        let h = cfg.hidden;
        let mut layers = Vec::with_capacity(cfg.n_layers);
        let mut layer_ids = Vec::new();
        let mut mats: Vec<Linear> = Vec::with_capacity(4);
        for (i, c) in cands.iter().enumerate() {
            if streamed[i] {
                let (kind, pieces) = located[i].clone().expect("only located matrices stream");
                let rows = c.parts.iter().map(|(_, d)| d[0]).sum();
                layer_ids.push(self.units.len());
                mats.push(self.stream(kind, rows, c.parts[0].1[1], pieces));
            } else {
                let parts = c
                    .parts
                    .iter()
                    .map(|(n, d)| self.read(n, d))
                    .collect::<Result<Vec<_>, _>>()?;
                mats.push(Linear::stack(parts));
            }
            if mats.len() == 4 {
                let Ok([qkv, wo, gate_up, down]) =
                    <[Linear; 4]>::try_from(std::mem::take(&mut mats))
                else {
                    unreachable!("four matrices")
                };
                let l = i / 4;
                let p = |s: &str| format!("blk.{l}.{s}.weight");
                let fam = cfg.family;
                let (hd, kvd) = (cfg.head_dim, cfg.kv_dim());
                let qkv_bias = if fam.qkv_bias {
                    let b = |s: &str| format!("blk.{l}.{s}.bias");
                    let mut v = self.vector(&b("attn_q"), cfg.n_heads * hd)?;
                    v.extend(self.vector(&b("attn_k"), kvd)?);
                    v.extend(self.vector(&b("attn_v"), kvd)?);
                    Some(v)
                } else {
                    None
                };
                let qk_norm = if fam.qk_norm {
                    Some((
                        self.vector(&p("attn_q_norm"), hd)?,
                        self.vector(&p("attn_k_norm"), hd)?,
                    ))
                } else {
                    None
                };
                let (post_attn_norm, post_ffn_norm) = if fam.post_norms {
                    (
                        Some(self.vector(&p("post_attention_norm"), h)?),
                        Some(self.vector(&p("post_ffw_norm"), h)?),
                    )
                } else {
                    (None, None)
                };
                let window = cfg.layer_window(l);
                layers.push(Layer {
                    attn_norm: self.vector(&p("attn_norm"), h)?,
                    qkv,
                    qkv_bias,
                    qk_norm,
                    wo,
                    post_attn_norm,
                    ffn_norm: self.vector(&p("ffn_norm"), h)?,
                    gate_up,
                    down,
                    post_ffn_norm,
                    window,
                    rope: usize::from(window.is_some()),
                });
            }
        }
        Ok((layers, layer_ids))
    }

    /// The output head: whole and resident, or in row pieces each read or streamed as the
    /// plan says; returns its pieces (first row, matrix) and the ids of the streamed ones.
    fn head(
        &mut self,
        cfg: &ModelConfig,
        head_name: &str,
        head_loc: Option<(u64, Kind, usize)>,
        r: &Residency,
    ) -> Result<(HeadPieces, Vec<usize>), ModelError> {
        let h = cfg.hidden;
        if r.head_pieces.len() == 1 && !r.head_streamed[0] {
            let whole = self.read(head_name, &[cfg.vocab, h])?;
            return Ok((vec![(0, Linear::stack(vec![whole]))], Vec::new()));
        }
        let (off, kind, hb) = head_loc.expect("only a located head is cut in pieces");
        let row_bytes = hb / cfg.vocab;
        let mut head = Vec::new();
        let mut head_ids = Vec::new();
        for (&(r0, r1), &s) in r.head_pieces.iter().zip(&r.head_streamed) {
            let piece = (off + (r0 * row_bytes) as u64, (r1 - r0) * row_bytes);
            if s {
                head_ids.push(self.units.len());
                head.push((r0, self.stream(kind, r1 - r0, h, vec![piece])));
            } else {
                use std::os::unix::fs::FileExt;
                let mut raw = vec![0u8; piece.1];
                File::open(self.path)
                    .and_then(|f| f.read_exact_at(&mut raw, piece.0))
                    .map_err(|source| ModelError::Io {
                        path: self.path.into(),
                        source,
                    })?;
                let q = QMatrix::from_raw(r1 - r0, h, kind, &raw);
                head.push((r0, Linear::stack(vec![q])));
            }
        }
        Ok((head, head_ids))
    }

    /// The token embedding: the head's (tied), read a row at a time from the file, or resident.
    fn embed(
        &mut self,
        cfg: &ModelConfig,
        tied: bool,
        from_file: bool,
    ) -> Result<Embed, ModelError> {
        let dims = [cfg.vocab, cfg.hidden];
        Ok(if tied {
            Embed::Tied
        } else if from_file {
            let (off, kind, _) =
                locate(self.ct, self.path, "token_embd.weight", &dims)?.expect("checked above");
            Embed::File(off, kind)
        } else {
            Embed::Own(self.read("token_embd.weight", &dims)?)
        })
    }
}

/// What the loader knows of the file when it plans which matrices stay resident.
struct Layout<'a> {
    ct: &'a gguf_file::Content,
    path: &'a Path,
    cfg: &'a ModelConfig,
    /// The matrices of a pass, in the order it uses them: four per layer.
    cands: &'a [Candidate],
    /// Where each candidate lies, if it can be streamed as it is.
    located: &'a [Option<Located>],
    /// The output head in the file: offset, kind and bytes, if it can be streamed.
    head_loc: Option<(u64, Kind, usize)>,
    /// Whether the head is the token embedding.
    tied: bool,
    /// Norms and RoPE tables: always resident.
    norm_bytes: u64,
    file_tensor_bytes: usize,
}

/// Which matrices a pass streams, and how the weights are held.
struct Residency {
    /// Per candidate.
    streamed: Vec<bool>,
    /// The head's row ranges, each streamed or not (`head_streamed`).
    head_pieces: Vec<(usize, usize)>,
    head_streamed: Vec<bool>,
    holding: WeightHolding,
    /// A separate embedding read a row at a time from the file.
    own_embed_from_file: bool,
    /// The stream's staging buffer in huge pages (faster reads), unless only small pages fit.
    huge_staging: bool,
}

/// Plans the weights' residency under `opts.budget` (`policy::plan_weights`, FlexInfer's
/// balanced locking or preservation), or everything resident without a budget.
fn plan_residency(l: &Layout<'_>, opts: &WeightOptions) -> Result<Residency, ModelError> {
    let cfg = l.cfg;
    let mut r = Residency {
        streamed: vec![false; l.cands.len()],
        head_pieces: vec![(0, cfg.vocab)],
        head_streamed: vec![false],
        holding: WeightHolding {
            budget: opts.budget,
            residency: "all".into(),
            ..WeightHolding::default()
        },
        own_embed_from_file: false,
        huge_staging: true,
    };
    let Some(budget) = opts.budget else {
        return Ok(r);
    };
    let sizes = Sizes::of(l);
    if budget >= sizes.total && opts.source != WeightSource::Mmap {
        return Ok(r);
    }
    // A separate embedding is read a row at a time from the file when it can be.
    r.own_embed_from_file =
        locate(l.ct, l.path, "token_embd.weight", &[cfg.vocab, cfg.hidden])?.is_some();
    let mut fixed = sizes.fixed;
    if !r.own_embed_from_file {
        fixed += sizes.embed;
    }
    if let Some((_, _, hb)) = l.head_loc {
        r.head_pieces = head_pieces(cfg, hb, &sizes.per_candidate);
    }
    let (tensors, which) = planner_tensors(l, &sizes.per_candidate, &r.head_pieces);
    let read_bps = match opts.read_bps {
        Some(b) => b,
        None => probe_read_bps(
            l.path,
            l.ct.tensor_data_offset,
            PROBE_BYTES.min(l.file_tensor_bytes),
        )?,
    };
    let resident: Vec<bool> = if opts.source == WeightSource::Mmap {
        vec![false; tensors.len()]
    } else {
        plan_resident(&tensors, budget, fixed, read_bps, opts, &mut r)?
    };
    r.holding.residency = match opts.source {
        WeightSource::Mmap => "mmap".into(),
        WeightSource::Direct => format!("{:?}", opts.residency).to_lowercase(),
    };
    r.holding.read_bps = read_bps;
    r.holding.fixed_bytes = fixed;
    r.head_streamed.clear();
    for (&kept, w) in resident.iter().zip(&which) {
        match w {
            Some(i) => r.streamed[*i] = !kept,
            None => r.head_streamed.push(!kept),
        }
    }
    if l.head_loc.is_none() {
        r.head_streamed = vec![false];
    }
    Ok(r)
}

/// The weights' bytes as the planner counts them.
struct Sizes {
    /// Bytes that stay resident whatever the plan: norms, tables, matrices that cannot stream
    /// (and a head that cannot), but not a separate embedding (`embed`).
    fixed: u64,
    /// Every weight's bytes.
    total: u64,
    /// Each candidate's bytes.
    per_candidate: Vec<u64>,
    /// A separate token embedding's bytes (0 when tied).
    embed: u64,
}

impl Sizes {
    fn of(l: &Layout<'_>) -> Self {
        let tensor_bytes = |name: &str| {
            l.ct.tensor_infos.get(name).map_or(0, |i| {
                (i.shape.elem_count() / i.ggml_dtype.block_size() * i.ggml_dtype.type_size()) as u64
            })
        };
        let (mut fixed, mut total) = (l.norm_bytes, l.norm_bytes);
        let mut per_candidate = Vec::with_capacity(l.cands.len());
        for (c, loc) in l.cands.iter().zip(l.located) {
            let bytes: u64 = match loc {
                Some((_, pieces)) => pieces.iter().map(|p| p.1 as u64).sum(),
                None => {
                    // Held as read (or requantized): about its f32 size over 4 at most.
                    let b = c.parts.iter().map(|(n, _)| tensor_bytes(n)).sum();
                    fixed += b;
                    b
                }
            };
            total += bytes;
            per_candidate.push(bytes);
        }
        let head = l.head_loc.map_or(0, |x| x.2 as u64);
        total += head;
        let embed = if l.tied {
            0
        } else {
            tensor_bytes("token_embd.weight")
        };
        total += embed;
        if l.head_loc.is_none() {
            fixed += head;
        }
        Sizes {
            fixed,
            total,
            per_candidate,
            embed,
        }
    }
}

/// The head's row ranges: pieces of whole GEMM tiles no bigger than the largest layer matrix,
/// so the head streams like a layer's matrices and its buffers stay small.
fn head_pieces(cfg: &ModelConfig, head_bytes: usize, sizes: &[u64]) -> Vec<(usize, usize)> {
    let row_bytes = head_bytes / cfg.vocab;
    let biggest = sizes.iter().copied().max().unwrap_or(head_bytes as u64) as usize;
    let tile = tile_rows(cfg.hidden);
    let rows = (biggest / row_bytes.max(1) / tile).max(1) * tile;
    (0..cfg.vocab)
        .step_by(rows)
        .map(|r| (r, (r + rows).min(cfg.vocab)))
        .collect()
}

/// The planner's tensors: the streamable layer matrices, then the head's pieces; with each,
/// the candidate it is (`None` for a head piece).
fn planner_tensors(
    l: &Layout<'_>,
    sizes: &[u64],
    head_pieces: &[(usize, usize)],
) -> (Vec<WeightTensor>, Vec<Option<usize>>) {
    let tensor = |kind, bytes: u64| WeightTensor {
        kind,
        bytes,
        compute: bytes as f64 / DECODE_COMPUTE_BPS,
        reuse: 1,
    };
    let mut tensors = Vec::new();
    let mut which = Vec::new();
    for (i, loc) in l.located.iter().enumerate() {
        if loc.is_some() {
            tensors.push(tensor((i % 4) as u32, sizes[i]));
            which.push(Some(i));
        }
    }
    if let Some((_, _, hb)) = l.head_loc {
        let row_bytes = (hb / l.cfg.vocab) as u64;
        for &(r0, r1) in head_pieces {
            tensors.push(tensor(4, (r1 - r0) as u64 * row_bytes));
            which.push(None);
        }
    }
    (tensors, which)
}

/// Which planner tensors stay resident under `budget` with `fixed` bytes taken, staging in huge
/// pages if the budget leaves room to round it up, else in small ones (`r.huge_staging`); the
/// plan's predictions go to `r.holding`.
fn plan_resident(
    tensors: &[WeightTensor],
    budget: u64,
    fixed: u64,
    read_bps: f64,
    opts: &WeightOptions,
    r: &mut Residency,
) -> Result<Vec<bool>, ModelError> {
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
    let room = budget.checked_sub(fixed);
    let minimum = fixed + policy::min_budget(tensors, &small);
    let plan_with = |model: &StreamModel| {
        room.ok_or(WeightPlanError::BelowMinimum { budget, minimum })
            .and_then(|room| policy::plan_weights(tensors, room, model, opts.residency))
    };
    let plan = plan_with(&huge)
        .or_else(|e| match e {
            WeightPlanError::BelowMinimum { .. } => {
                r.huge_staging = false;
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
    r.holding.predicted_pass_secs = plan.predicted.pass_secs;
    r.holding.predicted_stall_secs = plan.predicted.stall_secs;
    Ok(plan.resident)
}
