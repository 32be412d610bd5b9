//! The shape of a llama-family model, read from a GGUF file's metadata.

use candle_core::quantized::gguf_file::{Content, Value};

/// What went wrong reading a model's shape from GGUF metadata.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The architecture is not one of the llama family.
    #[error(
        "unsupported model architecture {arch:?}: llms runs llama-family models (llama, smollm, tinyllama shapes)"
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

/// The dimensions and constants of a llama-family transformer.
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

    /// The chunk shape of this model's KV cache with `tokens` tokens per chunk.
    pub fn chunk_shape(&self, tokens: usize) -> crate::kv::ChunkShape {
        crate::kv::ChunkShape {
            n_layers: self.n_layers,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            tokens,
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
        // Llama 2/3, SmolLM, TinyLlama and Mistral-without-sliding-window GGUFs all say "llama".
        if arch != "llama" {
            return Err(ConfigError::UnsupportedArch { arch });
        }
        let keys = Keys { md, arch: &arch };
        let int = |suffix: &str| keys.int(suffix);
        let float = |suffix: &str| keys.float(suffix);
        let n_layers = int("block_count")?;
        let hidden = int("embedding_length")?;
        let ffn = int("feed_forward_length")?;
        let n_heads = int("attention.head_count")?;
        let n_kv_heads = keys.int_or("attention.head_count_kv", n_heads)?;
        let max_ctx = int("context_length")?;
        if hidden % n_heads != 0 || n_heads % n_kv_heads != 0 {
            return Err(ConfigError::BadValue {
                key: format!("{arch}.attention.head_count"),
                reason: format!(
                    "{n_heads} query heads and {n_kv_heads} KV heads do not divide width {hidden}"
                ),
            });
        }
        let head_dim = hidden / n_heads;
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
        })
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
