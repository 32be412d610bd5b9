//! The shape of a model, read from a GGUF file's metadata: the dimensions, and what its
//! architecture's layers do beyond llama's, as data ([`Family`]) rather than branches in the
//! forward pass.

use candle_core::quantized::gguf_file::{Content, Value};

/// What went wrong reading a model's shape from GGUF metadata.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The architecture is none of the families the engine runs.
    #[error(
        "unsupported model architecture {arch:?}: llms runs llama (SmolLM, TinyLlama, Llama 2 and 3), qwen2 and gemma3 models"
    )]
    UnsupportedArch { arch: String },
    /// A required key is absent.
    #[error("GGUF metadata key {key:?} is missing")]
    MissingKey { key: String },
    /// A key has a value of the wrong type or out of range.
    #[error("GGUF metadata key {key:?} is invalid: {reason}")]
    BadValue { key: String, reason: String },
    /// The file is not a readable GGUF file.
    #[error("cannot read the GGUF header of {path}: {source}")]
    Read {
        path: std::path::PathBuf,
        source: Box<candle_core::Error>,
    },
}

/// The feed-forward layer's gate: `act(gate) * up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (SwiGLU): llama, qwen2.
    Silu,
    /// GELU, tanh approximation (GeGLU): gemma.
    GeluTanh,
}

/// Which dimensions of a head RoPE rotates together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pairs `(2i, 2i + 1)`: llama GGUFs (whose Q and K rows the converter permuted).
    Adjacent,
    /// Pairs `(i, i + rope_dim / 2)` (GPT-NeoX's): qwen2, gemma.
    Halves,
}

/// What an architecture's layers do beyond llama's. One value per `general.architecture`
/// ([`Family::of`]); the forward pass reads these fields and has no branch on the name.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Family {
    /// `general.architecture`.
    pub arch: &'static str,
    /// The feed-forward gate.
    pub activation: Activation,
    /// How RoPE pairs dimensions.
    pub rope_style: RopeStyle,
    /// Embeddings are multiplied by `sqrt(hidden)` on lookup.
    pub embed_scale: bool,
    /// Each query and key head is RMS-normed (`attn_q_norm`, `attn_k_norm`) before RoPE.
    pub qk_norm: bool,
    /// The attention and feed-forward outputs are RMS-normed (`post_attention_norm`,
    /// `post_ffw_norm`) before they are added to the residual stream.
    pub post_norms: bool,
    /// Q, K and V projections have biases (`attn_q.bias`...).
    pub qkv_bias: bool,
    /// With a sliding window in the metadata: every `swa_pattern`-th layer is global, the others
    /// attend to the window only (0: every layer global). The metadata key
    /// `<arch>.attention.sliding_window_pattern` overrides it.
    pub swa_pattern: usize,
    /// RoPE base of the sliding-window layers when the metadata names none.
    pub rope_base_local: f32,
    /// Channels per value group of the coded KV formats ([`crate::kv::ChunkShape::value_group`];
    /// 0: the whole head), as measured per family: Gemma 3's heads of 256 channels under one
    /// minimum and scale per token put the service's mix 2.0% over int8 in perplexity, groups of
    /// 32 0.5% (docs/bench-gemma3.md); on heads of 64 (SmolLM2) groups of 32 are worse.
    pub value_group: usize,
    /// Tokens per KV chunk by default ([`ModelConfig::chunk_tokens`]). A chunk is the unit the
    /// store reads and writes, so it must not be too small for a disk: Gemma 3 270M keeps 3 of
    /// its 18 layers past the window, one KV head each, and a 16-token chunk there is 13 KB, so
    /// bringing back a 32k-token context was 2,047 reads, bound by the disk's reads per second
    /// (57 ms; 32-token chunks: 35 ms, and the mix within 0.5% of int8 in perplexity either
    /// way; docs/bench-long.md).
    pub chunk_tokens: usize,
}

impl Family {
    /// Llama 2 and 3, SmolLM, TinyLlama, Mistral without a window: the GGUF says `llama`.
    pub const LLAMA: Family = Family {
        arch: "llama",
        activation: Activation::Silu,
        rope_style: RopeStyle::Adjacent,
        embed_scale: false,
        qk_norm: false,
        post_norms: false,
        qkv_bias: false,
        swa_pattern: 0,
        rope_base_local: 10_000.0,
        value_group: 0,
        chunk_tokens: 16,
    };
    /// Qwen 2 and 2.5.
    pub const QWEN2: Family = Family {
        arch: "qwen2",
        rope_style: RopeStyle::Halves,
        qkv_bias: true,
        ..Family::LLAMA
    };
    /// Gemma 3 (text): five sliding-window layers of every six.
    pub const GEMMA3: Family = Family {
        arch: "gemma3",
        activation: Activation::GeluTanh,
        rope_style: RopeStyle::Halves,
        embed_scale: true,
        qk_norm: true,
        post_norms: true,
        qkv_bias: false,
        swa_pattern: 6,
        rope_base_local: 10_000.0,
        value_group: 32,
        chunk_tokens: 32,
    };

    /// Every family the engine runs.
    pub const ALL: [Family; 3] = [Family::LLAMA, Family::QWEN2, Family::GEMMA3];

    /// The family of `general.architecture` = `arch`.
    pub fn of(arch: &str) -> Option<Family> {
        Family::ALL.into_iter().find(|f| f.arch == arch)
    }
}

/// The dimensions and constants of a transformer of one of the [`Family`]s.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// `general.architecture` (the metadata key prefix), e.g. `llama`.
    pub arch: String,
    /// Number of transformer blocks.
    pub n_layers: usize,
    /// Number of query heads.
    pub n_heads: usize,
    /// Number of key/value heads (GQA: divides `n_heads`).
    pub n_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Model (embedding) width.
    pub hidden: usize,
    /// Width of the SwiGLU feed-forward layer.
    pub ffn: usize,
    /// Vocabulary size (rows of the embedding table).
    pub vocab: usize,
    /// RoPE frequency base.
    pub rope_base: f32,
    /// Number of rotated dimensions of each head (the rest pass through).
    pub rope_dim: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// Maximum context length the model was trained for.
    pub max_ctx: usize,
    /// What the architecture's layers do beyond llama's.
    pub family: Family,
    /// Tokens a sliding-window layer attends to (the query's own and those before it), when the
    /// model has such layers.
    pub window: Option<usize>,
    /// Every `swa_pattern`-th layer is global when there is a window.
    pub swa_pattern: usize,
    /// RoPE base of the sliding-window layers.
    pub rope_base_local: f32,
    /// Linear RoPE position scale of the global layers (`1 / rope.scaling.factor`; 1 for none).
    pub rope_freq_scale: f32,
}

impl ModelConfig {
    /// Reads the shape from the metadata of the GGUF file at `path` (its header only, not the
    /// weights).
    pub fn from_gguf_file(path: &std::path::Path) -> Result<Self, ConfigError> {
        let read = |source| ConfigError::Read {
            path: path.to_owned(),
            source: Box::new(source),
        };
        let mut file = std::io::BufReader::new(
            std::fs::File::open(path).map_err(|e| read(candle_core::Error::from(e)))?,
        );
        let content = Content::read(&mut file).map_err(read)?;
        Self::from_gguf(&content)
    }

    /// Tokens per KV chunk by default: the family's ([`Family::chunk_tokens`]), but never more
    /// than a sliding window (the tests' tiny windowed models keep 16).
    pub fn chunk_tokens(&self) -> usize {
        match self.window {
            Some(w) if w > 0 => self.family.chunk_tokens.min(w).max(1),
            _ => self.family.chunk_tokens,
        }
    }

    /// Tokens per prefill step by default: sixteen of the model's chunks (256 tokens; 512 on
    /// Gemma 3, whose chunks are 32), so a recompute pass rebuilds sixteen chunks on every model
    /// and the weights' int8 panels are packed once per 512 tokens on Gemma 3, where packing
    /// its block formats is a tenth of prefill (docs/bench-gemma3.md).
    pub fn prefill_step(&self) -> usize {
        16 * self.chunk_tokens()
    }

    /// The chunk shape of this model's KV cache with `tokens` tokens per chunk.
    pub fn chunk_shape(&self, tokens: usize) -> crate::kv::ChunkShape {
        let global = (0..self.n_layers)
            .filter(|&l| self.layer_window(l).is_none())
            .fold(0u128, |m, l| m | 1 << l);
        crate::kv::ChunkShape {
            n_layers: self.n_layers,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            tokens,
            global: if self.window.is_some() {
                global
            } else {
                u128::MAX
            },
            window: self.window.unwrap_or(0),
            // A family's group applies to heads it divides into more than one group (the
            // tests' tiny models have narrower heads).
            value_group: match self.family.value_group {
                g if g > 0 && g < self.head_dim && self.head_dim.is_multiple_of(g) => g,
                _ => 0,
            },
        }
    }

    /// Reads the shape from GGUF metadata.
    pub fn from_gguf(content: &Content) -> Result<Self, ConfigError> {
        let md = &content.metadata;
        let arch = match md.get("general.architecture") {
            Some(Value::String(s)) => s.clone(),
            Some(_) => {
                return Err(ConfigError::BadValue {
                    key: "general.architecture".into(),
                    reason: "not a string".into(),
                });
            }
            None => {
                return Err(ConfigError::MissingKey {
                    key: "general.architecture".into(),
                });
            }
        };
        let Some(family) = Family::of(&arch) else {
            return Err(ConfigError::UnsupportedArch { arch });
        };
        let keys = Keys { md, arch: &arch };
        let int = |suffix: &str| keys.int(suffix);
        let float = |suffix: &str| keys.float(suffix);
        let n_layers = int("block_count")?;
        let hidden = int("embedding_length")?;
        let ffn = int("feed_forward_length")?;
        let n_heads = int("attention.head_count")?;
        let n_kv_heads = keys.int_or("attention.head_count_kv", n_heads)?;
        let max_ctx = int("context_length")?;
        if n_heads % n_kv_heads != 0 {
            return Err(ConfigError::BadValue {
                key: format!("{arch}.attention.head_count"),
                reason: format!("{n_kv_heads} KV heads do not divide {n_heads} query heads"),
            });
        }
        // Gemma's heads are wider than hidden / heads: the file says so.
        let head_dim = if md.contains_key(&keys.key("attention.key_length")) {
            let k = int("attention.key_length")?;
            let v = keys.int_or("attention.value_length", k)?;
            if v != k {
                return Err(ConfigError::BadValue {
                    key: format!("{arch}.attention.value_length"),
                    reason: format!(
                        "values of {v} next to keys of {k}: the cache needs them equal"
                    ),
                });
            }
            k
        } else if hidden % n_heads == 0 {
            hidden / n_heads
        } else {
            return Err(ConfigError::BadValue {
                key: format!("{arch}.attention.head_count"),
                reason: format!("{n_heads} query heads do not divide width {hidden}"),
            });
        };
        let rope_dim = keys.int_or("rope.dimension_count", head_dim)?;
        if rope_dim > head_dim || rope_dim % 2 != 0 {
            return Err(ConfigError::BadValue {
                key: format!("{arch}.rope.dimension_count"),
                reason: format!("{rope_dim} does not fit head dimension {head_dim}"),
            });
        }
        let vocab = match md.get("tokenizer.ggml.tokens") {
            Some(Value::Array(a)) => a.len(),
            _ => int("vocab_size")?,
        };
        let rope_base = float("rope.freq_base")?.unwrap_or(10_000.0);
        let rms_eps = float("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-5);
        let (window, swa_pattern, rope_base_local, rope_freq_scale) = keys.windows(family)?;
        Ok(Self {
            arch,
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            hidden,
            ffn,
            vocab,
            rope_base,
            rope_dim,
            rms_eps,
            max_ctx,
            family,
            window,
            swa_pattern,
            rope_base_local,
            rope_freq_scale,
        })
    }

    /// The sliding window of layer `layer`: `Some(tokens)` for a local layer, `None` for a
    /// global one.
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        let p = self.swa_pattern;
        self.window.filter(|_| p > 0 && layer % p < p - 1)
    }

    /// Bytes of the model's vectors held as f32: every layer's norms and biases, and the
    /// output norm.
    pub fn vector_bytes(&self) -> usize {
        let f = self.family;
        let (h, hd) = (self.hidden, self.head_dim);
        let per_layer = 2 * h
            + if f.qkv_bias {
                self.n_heads * hd + 2 * self.kv_dim()
            } else {
                0
            }
            + if f.qk_norm { 2 * hd } else { 0 }
            + if f.post_norms { 2 * h } else { 0 };
        4 * (self.n_layers * per_layer + h)
    }

    /// What embeddings are multiplied by on lookup: `sqrt(hidden)` for a family that scales
    /// them (gemma), else 1.
    pub fn embed_scale(&self) -> f32 {
        if self.family.embed_scale {
            (self.hidden as f32).sqrt()
        } else {
            1.0
        }
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }

    /// Width of the K (or V) projection: `n_kv_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// The `<arch>.*` keys of a GGUF file's metadata, read with their types and ranges checked.
struct Keys<'a> {
    md: &'a std::collections::HashMap<String, Value>,
    arch: &'a str,
}

impl Keys<'_> {
    /// The sliding window, its pattern, the local layers' RoPE base and the global layers'
    /// linear RoPE scale.
    fn windows(&self, family: Family) -> Result<(Option<usize>, usize, f32, f32), ConfigError> {
        let (md, arch) = (self.md, self.arch);
        let float = |suffix: &str| self.float(suffix);
        let keys = self;
        let window = Some(keys.int_or("attention.sliding_window", 0)?).filter(|&w| w > 0);
        let swa_pattern = keys.int_or("attention.sliding_window_pattern", family.swa_pattern)?;
        // A window with no pattern (Mistral's every-layer window) is not run: refuse it rather
        // than attend past it.
        if window.is_some() && swa_pattern == 0 {
            return Err(ConfigError::BadValue {
                key: format!("{arch}.attention.sliding_window"),
                reason: "a sliding window on every layer is not supported".into(),
            });
        }
        let rope_base_local = float("rope.freq_base_swa")?.unwrap_or(family.rope_base_local);
        let rope_freq_scale = match (
            md.get(&keys.key("rope.scaling.type")),
            float("rope.scaling.factor")?,
        ) {
            (Some(Value::String(t)), Some(f)) if t == "linear" && f > 0.0 => 1.0 / f,
            (Some(Value::String(t)), _) if t == "none" => 1.0,
            (None, _) => 1.0,
            (Some(v), f) => {
                return Err(ConfigError::BadValue {
                    key: format!("{arch}.rope.scaling.type"),
                    reason: format!(
                        "RoPE scaling {v:?} with factor {f:?} is not supported (linear is)"
                    ),
                });
            }
        };
        Ok((window, swa_pattern, rope_base_local, rope_freq_scale))
    }

    /// The full key of `suffix`.
    fn key(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.arch)
    }

    /// A positive integer (at most 2^24).
    fn int(&self, suffix: &str) -> Result<usize, ConfigError> {
        let key = self.key(suffix);
        let v = self
            .md
            .get(&key)
            .ok_or(ConfigError::MissingKey { key: key.clone() })?;
        let n = match v {
            Value::U8(x) => u64::from(*x),
            Value::U16(x) => u64::from(*x),
            Value::U32(x) => u64::from(*x),
            Value::U64(x) => *x,
            Value::I32(x) if *x >= 0 => *x as u64,
            Value::I64(x) if *x >= 0 => *x as u64,
            _ => {
                return Err(ConfigError::BadValue {
                    key,
                    reason: format!("expected a non-negative integer, found {v:?}"),
                });
            }
        };
        if n == 0 || n > (1 << 24) {
            return Err(ConfigError::BadValue {
                key,
                reason: format!("{n} is out of range"),
            });
        }
        Ok(n as usize)
    }

    /// A positive integer, or `default` when the key is absent.
    fn int_or(&self, suffix: &str, default: usize) -> Result<usize, ConfigError> {
        if self.md.contains_key(&self.key(suffix)) {
            self.int(suffix)
        } else {
            Ok(default)
        }
    }

    /// A float, if the key is present.
    fn float(&self, suffix: &str) -> Result<Option<f32>, ConfigError> {
        match self.md.get(&self.key(suffix)) {
            None => Ok(None),
            Some(Value::F32(x)) => Ok(Some(*x)),
            Some(Value::F64(x)) => Ok(Some(*x as f32)),
            Some(v) => Err(ConfigError::BadValue {
                key: self.key(suffix),
                reason: format!("expected a float, found {v:?}"),
            }),
        }
    }
}
